//go:build race

package passthrough

// raceEnabled: the race detector slows the file system several times over.
const raceEnabled = true
