//go:build tools

// Package tools pins the kwok command in this module's dependency graph, so that `go mod tidy`
// keeps everything `go build sigs.k8s.io/kwok/cmd/kwok` needs.
package tools

import _ "sigs.k8s.io/kwok/pkg/kwok/cmd"
