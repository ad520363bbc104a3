package vhostuser

import (
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// Classifier is implemented by request handlers that can tell a request
// worth a hand-off to a worker goroutine (a large read or write: the
// syscall dwarfs the hand-off, and another core can run it) from a cheap
// one, which is served inline on the ring's goroutine.
type Classifier interface {
	Heavy(in *bufvec.Vec) bool
}

// slot is the state of one request in flight: its chain, the memory table
// its segments point into, and the handler scratch that serves it. A ring
// has 1 + Config.Workers slots, allocated once; a slot is either free,
// being served inline by the ring goroutine, or lent to its worker.
type slot struct {
	chain    *virtqueue.DescChain
	mem      *virtqueue.GuestMemory
	handler  RequestHandler
	classify Classifier // nil: never offloaded
	wake     chan *runner
	hasG     bool // a worker goroutine waits on wake
}

func (r *vring) newSlots(n int) []*slot {
	slots := make([]*slot, n)
	for i := range slots {
		h := r.b.cfg.Handler.QueueHandler(r.index)
		c, _ := h.(Classifier)
		slots[i] = &slot{chain: virtqueue.NewDescChain(r.num), handler: h, classify: c}
	}
	return slots
}

// release drops the chain's segments and, for a lent chain, its reference
// to the memory table.
func (s *slot) release() {
	s.chain.Release()
	if s.mem != nil {
		s.mem.Put()
		s.mem = nil
	}
}

// runner serves one started, enabled ring: a goroutine that pops chains
// and serves cheap ones inline, handing heavy ones to the slots' worker
// goroutines while the back end's worker budget allows.
type runner struct {
	r        *vring
	q        *virtqueue.Queue
	kick     *os.File // nil: the ring is polled (kick sent with NOFD)
	stopping atomic.Bool
	done     chan struct{}
	slots    []*slot
	free     chan *slot // slots not in use
	cur      *slot      // the slot the ring goroutine holds, if any
	stats    *ringStats // nil with metrics off
}

// pollInterval is how often a ring without a kick fd is polled.
const pollInterval = 200 * time.Microsecond

func startRunner(r *vring, q *virtqueue.Queue, kickFD int, slots []*slot) *runner {
	rn := &runner{r: r, q: q, done: make(chan struct{}), slots: slots, free: make(chan *slot, len(slots)),
		stats: r.b.ringStats(r.index)}
	if rn.stats != nil {
		rn.stats.active.Store(true)
	}
	for _, s := range slots {
		rn.free <- s
	}
	if kickFD >= 0 {
		// A dup, so the poller owns its own fd and closing it cannot race
		// with the message loop replacing the kick fd.
		fd, err := unix.FcntlInt(uintptr(kickFD), unix.F_DUPFD_CLOEXEC, 0)
		if err == nil {
			if err = unix.SetNonblock(fd, true); err == nil {
				rn.kick = os.NewFile(uintptr(fd), "kick")
			} else {
				unix.Close(fd)
			}
		}
		if rn.kick == nil {
			r.log().Warn("cannot watch kick fd; polling the ring", "err", err)
		}
	}
	go rn.serve()
	return rn
}

// stop asks the ring goroutine to finish and waits until it has exited and
// every slot lent to a worker has come back: every chain popped has then
// been completed and pushed, so the Queue's LastAvail is exact.
func (rn *runner) stop() {
	rn.stopping.Store(true)
	if rn.kick != nil {
		rn.kick.SetReadDeadline(time.Unix(1, 0)) // wake a blocked read
	}
	// A request waiting for the VMM (FS_IO) would wait forever: the VMM
	// answers only after we answer the message that stops this ring.
	b := rn.r.b
	b.backend.abort()
	defer b.backend.endAbort()
	<-rn.done
	for range rn.slots {
		<-rn.free
	}
	for _, s := range rn.slots {
		if s.hasG {
			close(s.wake)
			s.hasG = false
		}
	}
	if rn.kick != nil {
		rn.kick.Close()
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

func (rn *runner) serve() {
	defer close(rn.done)
	if rn.stats != nil {
		defer rn.stats.active.Store(false)
	}
	debug.SetPanicOnFault(true)
	defer func() {
		if e := recover(); e != nil {
			rn.onFault(e)
			rn.stopping.Store(true)
			if rn.cur != nil { // its chain is lost with the ring
				rn.put(rn.cur)
			}
		}
	}()
	r, q := rn.r, rn.q
	var kickBuf [8]byte
	for !rn.stopping.Load() {
		rn.drain()
		if rn.stopping.Load() || q.Broken() {
			break
		}
		if q.EnableNotify() {
			continue // raced with the guest: more chains arrived
		}
		if err := q.Notify(); err != nil {
			r.log().Warn("notify guest", "err", err)
		}
		if rn.kick == nil {
			time.Sleep(pollInterval)
			continue
		}
		if _, err := rn.kick.Read(kickBuf[:]); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			if !errors.Is(err, unix.EAGAIN) {
				r.log().Warn("read kick fd", "err", err)
				break
			}
		}
	}
	if err := q.Notify(); err != nil {
		r.log().Warn("notify guest", "err", err)
	}
}

// drain serves available chains until the ring is empty or a stop is asked.
func (rn *runner) drain() {
	r, q := rn.r, rn.q
	for !rn.stopping.Load() {
		// Read avail.idx before taking the memory table: the chains seen
		// are translated with a table at least as new as the front end's
		// last acknowledged memory change.
		pending, err := q.Snapshot()
		if err != nil {
			r.log().Error("ring stopped serving", "err", err)
			return
		}
		if rn.stats != nil {
			rn.stats.seen.Store(uint32(q.SeenAvail()))
		}
		if !pending {
			return
		}
		mem := r.b.memory.Acquire()
		if mem == nil {
			return // memory withdrawn: nothing can be translated
		}
		rn.drainSeen(mem)
		mem.Put()
	}
}

// drainSeen serves the chains seen by the last Snapshot with table mem.
func (rn *runner) drainSeen(mem *virtqueue.GuestMemory) {
	r, q := rn.r, rn.q
	for !rn.stopping.Load() {
		// A slot is always free here: this goroutine holds none, and at
		// most len(slots)-1 are lent to workers.
		s := <-rn.free
		rn.cur = s
		ok, err := q.PopSeen(s.chain, mem)
		if !ok {
			rn.put(s)
			if err != nil {
				r.log().Error("ring stopped serving", "err", err)
			}
			return
		}
		if rn.stats != nil {
			rn.stats.popped.Add(1)
			rn.stats.taken.Store(uint32(q.LastAvail()))
		}
		switch {
		case err == nil:
			if q.AllowsUnmapped() {
				s.chain.Readable.SetBouncer(&r.b.backend)
				s.chain.Writable.SetBouncer(&r.b.backend)
			}
			if s.classify != nil && s.classify.Heavy(s.chain.Readable) && r.b.takeWorker() {
				// A lent chain may outlive this batch: it takes its own
				// reference (cannot fail: we hold one). Inline requests
				// share the batch's, which keeps shared atomics off the
				// common path.
				mem.TryGet()
				s.mem = mem
				rn.cur = nil
				rn.lend(s)
				continue
			}
			written := s.handler.Serve(s.chain.Readable, s.chain.Writable)
			// Notify as soon as the guest asks (EVENT_IDX keeps that
			// cheap): holding completions until the ring is empty let one
			// slow request delay the replies already pushed.
			if err := q.PushNotify(s.chain.Head, written); err != nil {
				r.log().Warn("notify guest", "err", err)
			}
			rn.completed()
		case errors.Is(err, virtqueue.ErrBadChain):
			rn.bad(err)
			q.Push(s.chain.Head, 0)
			rn.completed()
		default: // ErrBadHead: nothing to return
			rn.bad(err)
			rn.completed()
		}
		rn.put(s)
	}
}

// put returns the slot the ring goroutine holds to the free list.
func (rn *runner) put(s *slot) {
	s.release()
	rn.cur = nil
	rn.free <- s
}

// lend hands a popped chain to the slot's worker goroutine, starting it on
// first use.
func (rn *runner) lend(s *slot) {
	if !s.hasG {
		s.wake = make(chan *runner, 1)
		s.hasG = true
		go s.work(rn.r.b)
	}
	s.wake <- rn
}

// work serves the chains lent to the slot, pushing and notifying itself.
func (s *slot) work(b *Backend) {
	debug.SetPanicOnFault(true)
	for rn := range s.wake {
		s.serveLent(rn)
		b.putWorker()
		rn.free <- s
	}
}

func (s *slot) serveLent(rn *runner) {
	defer func() {
		if e := recover(); e != nil {
			rn.onFault(e)
			s.release()
		}
	}()
	written := s.handler.Serve(s.chain.Readable, s.chain.Writable)
	if err := rn.q.PushNotify(s.chain.Head, written); err != nil {
		rn.r.log().Warn("notify guest", "err", err)
	}
	rn.completed()
	s.release()
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
