//go:build tools

// Package tools pins the kube-apiserver command in this module's dependency graph, so that
// `go mod tidy` keeps everything `go build k8s.io/kubernetes/cmd/kube-apiserver` needs.
package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver/app"
