//go:build !race

package passthrough

const raceEnabled = false
