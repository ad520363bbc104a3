package main

import (
	"fmt"
	"os"
	"runtime/pprof"

	"github.com/govirtiofsd/govirtiofsd/internal/sandbox"
)

// envCPUProfile names a file the daemon writes a Go CPU profile of its
// serving process to (go tool pprof), from before the first connection
// until the front end disconnects or a signal ends the daemon. It is for
// developers measuring the daemon (test/bench -profile), not an option:
// the profiler's per-thread timers (timer_create, setitimer) are outside
// the seccomp allowlist, so it needs --seccomp none (or log).
const envCPUProfile = "GOVIRTIOFSD_CPUPROFILE"

const fileCPUProfile = "cpuprofile" // the envCPUProfile file, handed into the sandbox

// cpuProfileFile opens the envCPUProfile file, if one is asked for, in the
// first process, where the host's paths are at hand. seccomp is the mode the
// sandbox will load.
func cpuProfileFile(seccomp sandbox.SeccompMode) ([]sandbox.File, error) {
	path := os.Getenv(envCPUProfile)
	if path == "" {
		return nil, nil
	}
	if seccomp == sandbox.SeccompKill || seccomp == sandbox.SeccompTrap {
		return nil, fmt.Errorf("%s needs --seccomp none or log: the profiler's timers are outside the allowlist", envCPUProfile)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", envCPUProfile, err)
	}
	return []sandbox.File{{Name: fileCPUProfile, File: f}}, nil
}

// startCPUProfile starts the profile on the file handed in, if any, and
// returns what ends it.
func startCPUProfile(in *sandbox.Inside) (stop func(), err error) {
	f := in.File(fileCPUProfile)
	if f == nil {
		return func() {}, nil
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", envCPUProfile, err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
