//go:build tools

// Package tools pins the promtool command in this module's dependency graph, so that
// `go mod tidy` keeps everything `go build github.com/prometheus/prometheus/cmd/promtool` needs.
package tools

import _ "github.com/prometheus/prometheus/cmd/promtool"
