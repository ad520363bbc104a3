//go:build !race && !schedcheck

package vhostuser

const checkRules = false
