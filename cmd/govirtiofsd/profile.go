package main

import (
	"fmt"
	"os"
	"runtime/pprof"
	"runtime/trace"

	"github.com/govirtiofsd/govirtiofsd/internal/sandbox"
)

// Developer profiles of the serving process, for people measuring the
// daemon (test/bench -profile and -trace), not options. Each names a file
// the daemon writes from before the first connection until the front end
// disconnects or a signal ends the daemon:
//
//   - envCPUProfile: a Go CPU profile (go tool pprof);
//   - envTrace: a Go execution trace (go tool trace): where goroutines
//     block, wake and run, syscall by syscall.
//
// Both need --seccomp none (or log): the profiler's per-thread timers
// (timer_create, setitimer) and the tracer's clock and stack walks are
// outside the allowlist.
const (
	envCPUProfile = "GOVIRTIOFSD_CPUPROFILE"
	envTrace      = "GOVIRTIOFSD_TRACE"
)

// devProfile is one of the files above, handed into the sandbox under
// file.
type devProfile struct {
	env, file string
	start     func(f *os.File) error
	stop      func()
}

var devProfiles = []devProfile{
	{envCPUProfile, "cpuprofile", func(f *os.File) error { return pprof.StartCPUProfile(f) }, pprof.StopCPUProfile},
	{envTrace, "trace", func(f *os.File) error { return trace.Start(f) }, trace.Stop},
}

// profileFiles opens the files asked for in the first process, where the
// host's paths are at hand. seccomp is the mode the sandbox will load.
func profileFiles(seccomp sandbox.SeccompMode) ([]sandbox.File, error) {
	var files []sandbox.File
	for _, p := range devProfiles {
		path := os.Getenv(p.env)
		if path == "" {
			continue
		}
		if seccomp == sandbox.SeccompKill || seccomp == sandbox.SeccompTrap {
			return nil, fmt.Errorf("%s needs --seccomp none or log: the profiler is outside the allowlist", p.env)
		}
		f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p.env, err)
		}
		files = append(files, sandbox.File{Name: p.file, File: f})
	}
	return files, nil
}

// startProfiles starts a profile on each file handed in and returns what
// ends them.
func startProfiles(in *sandbox.Inside) (stop func(), err error) {
	var stops []func()
	stop = func() {
		for _, s := range stops {
			s()
		}
	}
	for _, p := range devProfiles {
		f := in.File(p.file)
		if f == nil {
			continue
		}
		if err := p.start(f); err != nil {
			f.Close()
			stop()
			return nil, fmt.Errorf("%s: %w", p.env, err)
		}
		stops = append(stops, func() {
			p.stop()
			f.Close()
		})
	}
	return stop, nil
}
