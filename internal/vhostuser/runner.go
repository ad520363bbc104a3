package vhostuser

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// pollInterval is how often a ring without a kick fd (SET_VRING_KICK with
// NOFD: the front end asks to be polled) is looked at (doc.go, Tunables).
const pollInterval = 200 * time.Microsecond

// runner serves one started, enabled ring.
type runner struct {
	r        *vring
	q        *virtqueue.Queue
	kick     *kickWatch // nil: the ring is polled
	stats    *ringStats // nil with metrics off
	stopping atomic.Bool
	done     chan struct{} // closed when the last server has exited

	// mu guards the Queue's consumer side (Snapshot, PopSeen, EnableNotify,
	// Seen, Waiting) and the fields below; unlock (rules.go) releases it.
	mu       sync.Mutex
	servers  []*server
	parked   []*server // never started, or parked; most recently parked last
	watching bool      // a server sleeps on the kick fd
	awake    int       // servers started and not parked
	extras   int       // worker budget units the ring holds: at most awake-1
	live     int       // server goroutines running
	// lastWrite is the node of the last large write popped (Classify).
	lastWrite uint64
	// mem is the memory table the chains seen by the last Snapshot are
	// translated with (referenced).
	mem *virtqueue.GuestMemory
}

// server is one goroutine serving a ring.
type server struct {
	rn      *runner
	index   int // in runner.servers and vring.slots
	slot    *slot
	wake    chan struct{}
	started bool
	mem     *virtqueue.GuestMemory // reference covering the chain s serves
	// unsignalled counts the replies s pushed since it last signalled.
	unsignalled int
}

func startRunner(r *vring, q *virtqueue.Queue, kickFD int) *runner {
	rn := &runner{r: r, q: q, done: make(chan struct{}), stats: r.b.ringStats(r.index)}
	if rn.stats != nil {
		rn.stats.active.Store(true)
	}
	n := 1 + r.b.cfg.Workers
	if r.index == 0 {
		n = 1 // FORGET and INTERRUPT are never worth a second core
	}
	rn.servers = make([]*server, n)
	rn.parked = make([]*server, 0, n)
	for i := range rn.servers {
		rn.servers[i] = &server{rn: rn, index: i, wake: make(chan struct{}, 1)}
	}
	for i := n - 1; i >= 1; i-- {
		rn.parked = append(rn.parked, rn.servers[i]) // the lowest index is woken first
	}
	if kickFD >= 0 {
		k, err := newKickWatch(kickFD)
		if err != nil {
			r.log().Warn("cannot watch kick fd; polling the ring", "err", err)
		}
		rn.kick = k
	}
	rn.mu.Lock()
	rn.awake++
	rn.startLocked(rn.servers[0])
	rn.unlock()
	return rn
}

// stop asks the servers to finish and waits until every one has exited:
// every chain popped has then been served and pushed, so the Queue's
// LastAvail is exact (GET_VRING_BASE).
func (rn *runner) stop() {
	// A request waiting for the VMM (FS_IO) would wait forever: the VMM
	// answers only after we answer the message that stops this ring.
	b := rn.r.b
	b.channel.abort()
	defer b.channel.endAbort()
	rn.mu.Lock()
	rn.endLocked()
	rn.unlock()
	<-rn.done
	putMem(&rn.mem)
	if rn.kick != nil {
		rn.kick.close()
	}
	// The ring's memory may fault (the guest put it in a DAX window page
	// whose file was truncated): that must not end the message loop.
	if err := faultSafe(func() error { return rn.q.Notify() }); err != nil {
		rn.r.log().Warn("notify guest", "err", err)
	}
}

// faultSafe runs f on a goroutine that panics on faults (the message
// loop: Backend.Serve) and turns a fault on guest memory into an error.
// Other panics go on.
func faultSafe(f func() error) (err error) {
	defer func() {
		if e := recover(); e != nil {
			fault, ok := e.(interface{ Addr() uintptr })
			if !ok {
				panic(e)
			}
			err = fmt.Errorf("fault on guest memory at %#x", fault.Addr())
		}
	}()
	return f()
}

// endLocked makes every server finish what it holds and exit.
func (rn *runner) endLocked() {
	rn.stopping.Store(true)
	if rn.kick != nil {
		rn.kick.interrupt()
	}
	for len(rn.parked) > 0 {
		if s := rn.parked[len(rn.parked)-1]; !s.started {
			rn.parked = rn.parked[:len(rn.parked)-1]
			continue
		}
		rn.wakeLocked()
	}
}

// startLocked runs s for the first time.
func (rn *runner) startLocked(s *server) {
	r := rn.r
	for len(r.slots) <= s.index {
		r.slots = append(r.slots, nil) // the message loop reads slots only after stop
	}
	if r.slots[s.index] == nil {
		r.slots[s.index] = r.newSlot()
	}
	s.slot = r.slots[s.index]
	s.started = true
	rn.live++
	go s.run()
}

// wakeLocked sets the most recently parked server running.
func (rn *runner) wakeLocked() {
	s := rn.parked[len(rn.parked)-1]
	rn.parked = rn.parked[:len(rn.parked)-1]
	rn.awake++
	if !s.started {
		rn.startLocked(s)
		return
	}
	s.wake <- struct{}{} // buffered: a parked server reads it once
}

// spreadLocked wakes another server, after s popped a heavy chain with more
// waiting, if one is parked and the back end's worker budget allows.
func (rn *runner) spreadLocked() {
	if len(rn.parked) == 0 || rn.stopping.Load() || !rn.r.b.takeWorker() {
		return
	}
	rn.extras++
	rn.wakeLocked()
}

// run is a server's goroutine.
func (s *server) run() {
	rn := s.rn
	debug.SetPanicOnFault(true)
	defer func() {
		if e := recover(); e != nil {
			// The chain is lost with the ring: guest memory faulted,
			// and the other rings map the same memory.
			rn.onFault(e)
			s.slot.chain.Release()
			rn.mu.Lock()
			rn.endLocked()
			rn.unlock()
		}
		rn.mu.Lock()
		s.leaveLocked()
		rn.live--
		last := rn.live == 0
		if last && rn.stats != nil {
			rn.stats.active.Store(false)
		}
		rn.unlock()
		if last {
			close(rn.done) // the message loop takes the ring back: nothing of it is touched after
		}
	}()
	for s.next() {
		sl := s.slot
		written := sl.handler.Serve(sl.chain.Readable, sl.chain.Writable)
		// During a migration the reply's pages are logged before the
		// used index publishes it.
		rn.q.LogWritten(sl.chain, written)
		rn.q.Push(sl.chain.Token, written)
		s.unsignalled++
		rn.completed()
		sl.chain.Release()
	}
}

// next pops the ring's next chain into s.slot, waiting while there is none,
// and reports false when s must exit. It signals the guest for the replies
// s pushed once they are at least as many as the chains waiting in the
// ring (the guest then has fewer requests queued than answers it has not
// heard of), and always before s waits or exits.
func (s *server) next() bool {
	rn := s.rn
	q := rn.q
	rn.mu.Lock()
	defer rn.unlock()
	for {
		if s.unsignalled > 0 && q.Waiting(s.unsignalled+1) <= s.unsignalled {
			s.signal()
		}
		if rn.stopping.Load() {
			s.signal()
			return false
		}
		switch st := rn.popLocked(s); st {
		case popped:
			var heavy, slow bool
			var node uint64
			if c := s.slot.classify; c != nil {
				heavy, node, slow = c.Classify(s.slot.chain.Readable)
			}
			if slow {
				s.signal() // the replies before it must not wait for it
			}
			// A second server for a write to the file the last one
			// wrote would only wait for the file's lock.
			if heavy && q.Waiting(1) > 0 && (node == 0 || node != rn.lastWrite) {
				rn.spreadLocked()
			}
			if node != 0 {
				rn.lastWrite = node
			}
			return true
		case popEnded:
			rn.endLocked()
		case popEmpty, popNoMemory:
			if rn.watching {
				s.parkLocked()
			} else {
				s.watchLocked(st == popNoMemory)
			}
		}
	}
}

// signal signals the guest, if it asked for a signal, when s pushed replies
// since it last did.
func (s *server) signal() {
	if s.unsignalled == 0 {
		return
	}
	s.unsignalled = 0
	if err := s.rn.q.Notify(); err != nil {
		s.rn.r.log().Warn("notify guest", "err", err)
	}
}

// leaveLocked drops what a server holds while it does not serve: its memory
// reference and, if the ring is left with fewer servers awake than budget
// units held, a unit of the worker budget. Units belong to the ring, not to
// a server: the first server woken may be the one that stays awake.
func (s *server) leaveLocked() {
	rn := s.rn
	putMem(&s.mem)
	rn.awake--
	for rn.extras > max(rn.awake-1, 0) {
		rn.r.b.putWorker()
		rn.extras--
	}
}

// parkLocked sleeps until another server (or stop) wakes s. mu is released
// meanwhile.
func (s *server) parkLocked() {
	rn := s.rn
	s.leaveLocked()
	rn.parked = append(rn.parked, s)
	rn.unlock()
	<-s.wake
	rn.mu.Lock()
}

// watchLocked waits for the guest to publish chains: it enables the guest's
// kicks and, unless chains arrived meanwhile, sleeps on the kick fd. mu is
// released while it sleeps.
func (s *server) watchLocked(noMemory bool) {
	rn := s.rn
	if !noMemory && rn.q.EnableNotify() {
		return // raced with the guest: more chains arrived
	}
	// An idle ring must not pin a memory table the front end replaced
	// (an unplugged region would stay mapped): the next pop takes the
	// current one again.
	putMem(&s.mem)
	putMem(&rn.mem)
	rn.watching = true
	rn.unlock()
	// Yield once per wait, or the runtime takes a server that only
	// serves and sleeps in ppoll for a hog (doc.go, Rationale).
	runtime.Gosched()
	var err error
	if rn.kick == nil {
		time.Sleep(pollInterval)
	} else {
		err = rn.kick.wait()
	}
	rn.mu.Lock()
	rn.watching = false
	if err != nil {
		rn.r.log().Warn("watch ring", "err", err)
		rn.endLocked()
	}
}

// putMem drops the table reference *m holds, if any.
func putMem(m **virtqueue.GuestMemory) {
	if *m != nil {
		(*m).Put()
		*m = nil
	}
}

// onFault turns a fault on guest memory (the front end shrank the file
// behind a mapping: SIGBUS) into a logged error instead of a dead daemon.
// Other panics are real bugs and go on.
func (rn *runner) onFault(e any) {
	fault, ok := e.(interface{ Addr() uintptr })
	if !ok {
		panic(e)
	}
	rn.r.log().Error("fault on guest memory; ring stopped", "addr", fmt.Sprintf("%#x", fault.Addr()))
}

// popState is what popLocked found.
type popState int

const (
	popped      popState = iota // a chain to serve
	popBad                      // a malformed chain, already answered
	popEmpty                    // nothing published
	popNoMemory                 // chains wait, but no memory table is mapped
	popEnded                    // the ring stopped serving
)

// popLocked takes the next chain into s.slot, translated with a table s
// holds a reference on.
func (rn *runner) popLocked(s *server) popState {
	q := rn.q
	if !q.Seen() {
		// Read avail.idx before choosing the memory table: the chains
		// seen are translated with a table at least as new as the front
		// end's last acknowledged memory change.
		pending, err := q.Snapshot()
		if err != nil {
			rn.r.log().Error("ring stopped serving", "err", err)
			return popEnded
		}
		if rn.stats != nil {
			rn.stats.depth.Store(uint32(q.Waiting(int(q.Size()))))
		}
		if !pending {
			return popEmpty
		}
		if cur := rn.r.b.memory.Current(); cur != rn.mem {
			putMem(&rn.mem)
			rn.mem = rn.r.b.memory.Acquire()
		}
	}
	if rn.mem == nil {
		return popNoMemory // memory withdrawn: nothing can be translated
	}
	if s.mem != rn.mem {
		putMem(&s.mem)
		rn.mem.TryGet() // cannot fail: the runner holds a reference
		s.mem = rn.mem
	}
	c := s.slot.chain
	ok, err := q.PopSeen(c, s.mem)
	if !ok {
		if err != nil {
			rn.r.log().Error("ring stopped serving", "err", err)
			return popEnded
		}
		return popEmpty
	}
	if rn.stats != nil {
		rn.stats.took()
	}
	switch {
	case err == nil:
		if q.AllowsUnmapped() {
			c.Readable.SetBouncer(&rn.r.b.channel)
			c.Writable.SetBouncer(&rn.r.b.channel)
		}
		return popped
	case errors.Is(err, virtqueue.ErrBadChain):
		rn.bad(err)
		q.Push(c.Token, 0)
		s.unsignalled++
	default: // ErrBadHead: nothing to return
		rn.bad(err)
	}
	rn.completed()
	c.Release()
	return popBad
}

// completed counts a chain answered (or dropped, for a bad head).
func (rn *runner) completed() {
	if rn.stats != nil {
		rn.stats.completed.Add(1)
	}
}

// bad logs a malformed chain, rate-limited: the 1st, 2nd, 4th, 8th... so a
// hostile guest cannot flood the log.
func (rn *runner) bad(err error) {
	n := rn.r.badSeen.Add(1)
	if n&(n-1) == 0 {
		rn.r.log().Warn("malformed chain returned", "err", err, "count", n)
	}
}

// takeWorker claims one unit of the back end's worker budget, shared by
// all rings: one atomic add, no lock.
func (b *Backend) takeWorker() bool {
	if b.cfg.Workers <= 0 {
		return false
	}
	if b.busyWorkers.Add(1) > int32(b.cfg.Workers) {
		b.busyWorkers.Add(-1)
		return false
	}
	return true
}

func (b *Backend) putWorker() { b.busyWorkers.Add(-1) }
