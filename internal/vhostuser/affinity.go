package vhostuser

import (
	"golang.org/x/sys/unix"
)

// Where the rings' servers run.
//
// With several rings busy with small requests, each ring's server sleeps
// in ppoll and wakes thousands of times a second, and Linux places a
// waking thread near where it last ran. Two servers that once shared a CPU
// keep sharing it: on 2 CPUs with 2 rings of 4 KiB writes, runs settled
// either with the servers on a CPU each or both on one, the daemon then
// held at exactly 1 CPU and 30-40 % slower, a different mode each run.
//
// So while two or more request rings run, the CPUs the process may use are
// dealt out among them (the k-th running ring takes the k-th, (k+n)-th...
// CPU of the set), and each ring's first server keeps to its ring's share
// while it serves small requests. Only then: a server busy with large
// reads and writes seldom sleeps, the scheduler balances it well, and
// tied to one CPU it only waited there for the front end's thread (1 MiB
// writes to one file through 2 rings were 10 % slower). And only the
// first server: a ring's extra servers, woken for large requests, run
// anywhere, so a guest that enables two rings but keeps one busy still
// has every CPU for it. One running ring, one CPU, or a set that cannot be
// read: no affinity at all. Affinity only places threads: a call that
// fails (a cpuset shrunk since) is ignored.

// cpuPlan is one dealing of the CPUs, replaced whole whenever the set of
// running rings changes (Backend.replanCPUs) and read without a lock. It
// also lists the running request rings' runners (streaming).
type cpuPlan struct {
	all     *unix.CPUSet           // the process's set when the back end was made
	share   [MaxRings]*unix.CPUSet // nil: the ring's servers run anywhere
	runners []*runner              // running request rings, by index
}

// allCPUs returns the calling thread's CPU set when it has two CPUs or
// more, else nil.
func allCPUs() *unix.CPUSet {
	var set unix.CPUSet
	if unix.SchedGetaffinity(0, &set) != nil || set.Count() < 2 {
		return nil
	}
	return &set
}

// dealCPUs deals all out among the running request rings, by index.
func dealCPUs(all *unix.CPUSet, running []int) *cpuPlan {
	p := &cpuPlan{all: all}
	if all == nil || len(running) < 2 {
		return p
	}
	var cpus []int
	for c := range len(all) * 64 {
		if all.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	shares := make([]unix.CPUSet, len(running))
	if len(cpus) >= len(running) {
		for k, c := range cpus {
			shares[k%len(running)].Set(c)
		}
	} else {
		for k := range shares {
			shares[k].Set(cpus[k%len(cpus)])
		}
	}
	for k, index := range running {
		p.share[index] = &shares[k]
	}
	return p
}

// replanCPUs deals the CPUs again for the rings running now. It runs on
// the message loop, which alone starts and stops rings.
func (b *Backend) replanCPUs() {
	var running []int
	var runners []*runner
	for i := 1; i < MaxRings; i++ {
		if r := b.rings[i]; r != nil && r.run != nil {
			running = append(running, i)
			runners = append(runners, r.run)
		}
	}
	p := dealCPUs(b.cpus, running)
	p.runners = runners
	b.plan.Store(p)
}

// place keeps the calling thread, locked to s, to the share the current
// plan gives s's ring: one atomic load while the plan is unchanged.
func (s *server) place() {
	if !s.first || s.loose {
		return
	}
	p := s.rn.r.b.plan.Load()
	if p == s.placed || p == nil {
		return
	}
	want := p.share[s.rn.r.index]
	if had := s.placed; want != nil {
		unix.SchedSetaffinity(0, want)
	} else if had != nil && had.share[s.rn.r.index] != nil {
		unix.SchedSetaffinity(0, p.all)
	}
	s.placed = p
}

// unplace gives the calling thread back the whole set before s lets go of
// it: the Go scheduler may run any goroutine on it next.
func (s *server) unplace() {
	if p := s.placed; p != nil && p.share[s.rn.r.index] != nil {
		unix.SchedSetaffinity(0, p.all)
	}
	s.placed = nil
}

// cheapToPin is how many small requests in a row bring a first server that
// served a large one back to its ring's share: traffic that mixes the two
// leaves it loose rather than moving it back and forth.
const cheapToPin = 32

// follow is called before s serves a request, heavy or not (Classify).
func (s *server) follow(heavy bool) {
	if !s.first {
		return
	}
	if heavy {
		s.cheap = 0
		if !s.loose {
			s.unplace()
			s.loose = true
		}
		return
	}
	if s.loose {
		if s.cheap++; s.cheap < cheapToPin {
			return
		}
		s.loose = false
		s.place()
	}
}
