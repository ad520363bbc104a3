package main

import (
	"runtime"
	"sync"
)

// procs is the process's share of Ps (GOMAXPROCS) for the vhost-user back
// end. A ring's watcher sleeps in ppoll(2) holding its thread's P, so the
// process has one P more than the CPUs for each ring watched, and the Ps
// the CPUs stand for stay free for the servers that work
// (internal/vhostuser's package comment, Rationale).
var procs struct {
	sync.Mutex
	cpus    int // GOMAXPROCS before the first reservation
	watched int // Ps added: the most rings any back end watched
}

// reserveWatcherProcs is vhostuser.Config.RingsWatched: room for n
// watchers. The Ps only grow and are never given back when a ring stops:
// changing GOMAXPROCS stops the world (Rationale).
func reserveWatcherProcs(n int) {
	procs.Lock()
	defer procs.Unlock()
	if procs.watched == 0 {
		procs.cpus = runtime.GOMAXPROCS(0)
	}
	if n > procs.watched {
		procs.watched = n
		runtime.GOMAXPROCS(procs.cpus + n)
	}
}

// defaultWorkers is the worker budget without --thread-pool-size: one
// fewer than the CPUs this process may run on (GOMAXPROCS, which heeds a
// cgroup CPU limit, less the watchers' Ps; at least one), so a busy ring
// has one server per CPU.
func defaultWorkers() int {
	procs.Lock()
	defer procs.Unlock()
	cpus := runtime.GOMAXPROCS(0)
	if procs.watched > 0 {
		cpus = procs.cpus
	}
	return max(cpus-1, 1)
}
