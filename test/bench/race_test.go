//go:build race

package bench

// The race runtime allocates on its own in syscall wrappers.
const raceEnabled = true
