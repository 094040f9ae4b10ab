//go:build tools

// Package tools pins the kube-controller-manager and kube-scheduler commands in this module's
// dependency graph, so that `go mod tidy` keeps everything their builds need.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
)
