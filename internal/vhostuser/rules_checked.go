//go:build race || schedcheck

package vhostuser

const checkRules = true // every test build of the project is -race
