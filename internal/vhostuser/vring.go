package vhostuser

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// vring is the daemon's view of one virtqueue: what the front end configured
// and, once the ring is started (SET_VRING_KICK) and enabled, the goroutine
// that serves it.
//
// Configuration fields are touched only by the message loop. The serving
// goroutine owns the Queue's consumer side while it runs; the message loop
// stops it (and waits) before it touches the Queue again.
type vring struct {
	index int
	b     *Backend

	num     uint16
	addr    vringAddr
	hasAddr bool
	base    uint16
	enabled bool

	kickFD  int // -1: none received yet
	kickSet bool
	callFD  int // the fd we own; the Queue signals it under its lock
	errFD   int

	queue   *virtqueue.Queue // non-nil while started
	handler RequestHandler

	run     *runner // non-nil while the serving goroutine runs
	badSeen atomic.Uint64
}

func newVring(b *Backend, index int) *vring {
	return &vring{index: index, b: b, kickFD: -1, callFD: -1, errFD: -1}
}

func (r *vring) started() bool { return r.queue != nil }

// log returns a logger tagged with the ring index.
func (r *vring) log() *slog.Logger { return r.b.log.With("queue", r.index) }

// start creates the Queue from the configuration. The front end starts a
// ring with SET_VRING_KICK; it is then served once enabled.
func (r *vring) start() error {
	if !r.hasAddr {
		return errors.New("ring address not set")
	}
	if r.num == 0 {
		return errors.New("ring size not set")
	}
	mem := r.b.memory.Acquire()
	if mem == nil {
		return errors.New("no memory table")
	}
	defer mem.Put()
	q, err := virtqueue.New(virtqueue.Config{
		Size:      r.num,
		DescAddr:  r.addr.desc,
		AvailAddr: r.addr.avail,
		UsedAddr:  r.addr.used,
		AvailBase: r.base,
		EventIdx:  r.b.acked&featEventIdx != 0,
		Indirect:  r.b.acked&featIndirectDesc != 0,
	}, mem)
	if err != nil {
		return err
	}
	q.SetCall(r.callFD)
	r.queue = q
	if r.handler == nil {
		r.handler = r.b.cfg.Handler.QueueHandler(r.index)
	}
	r.b.log.Debug("ring started", "queue", r.index, "size", r.num, "base", r.base,
		"event_idx", r.b.acked&featEventIdx != 0, "indirect", r.b.acked&featIndirectDesc != 0)
	return nil
}

// resume starts the serving goroutine if the ring is started and enabled.
func (r *vring) resume() {
	if r.run != nil || r.queue == nil || !r.enabled || r.queue.Broken() {
		return
	}
	r.run = startRunner(r, r.queue, r.kickFD)
}

// pause stops the serving goroutine and waits until every chain it popped
// has been completed and pushed.
func (r *vring) pause() {
	if r.run == nil {
		return
	}
	r.run.stop()
	r.run = nil
}

// stop pauses the ring, records where it stopped and releases its Queue: the
// GET_VRING_BASE semantics.
func (r *vring) stop() uint16 {
	r.pause()
	if r.queue != nil {
		r.base = r.queue.LastAvail()
		r.queue.Close()
		r.queue = nil
	}
	if r.kickFD >= 0 {
		unix.Close(r.kickFD)
		r.kickFD = -1
	}
	r.kickSet = false
	return r.base
}

// setCall installs a new call fd (or -1). The old fd is closed only after
// the Queue has stopped using it.
func (r *vring) setCall(fd int) {
	old := r.callFD
	r.callFD = fd
	if r.queue != nil {
		r.queue.SetCall(fd) // returns only when no one signals the old fd
	}
	if old >= 0 {
		unix.Close(old)
	}
}

func (r *vring) setErr(fd int) {
	if r.errFD >= 0 {
		unix.Close(r.errFD)
	}
	r.errFD = fd
}

// reset forgets everything the front end configured.
func (r *vring) reset() {
	r.stop()
	r.setCall(-1)
	r.setErr(-1)
	r.num, r.base, r.enabled, r.hasAddr = 0, 0, false, false
	r.addr = vringAddr{}
}

// runner is the goroutine serving one started, enabled ring.
type runner struct {
	r        *vring
	q        *virtqueue.Queue
	kick     *os.File // nil: the ring is polled (kick sent with NOFD)
	stopping atomic.Bool
	done     chan struct{}
	wg       sync.WaitGroup
}

// pollInterval is how often a ring without a kick fd is polled.
const pollInterval = 200 * time.Microsecond

func startRunner(r *vring, q *virtqueue.Queue, kickFD int) *runner {
	rn := &runner{r: r, q: q, done: make(chan struct{})}
	if kickFD >= 0 {
		// A dup, so the poller owns its own fd and closing it cannot race
		// with the message loop replacing the kick fd.
		fd, err := unix.FcntlInt(uintptr(kickFD), unix.F_DUPFD_CLOEXEC, 0)
		if err == nil {
			if err := unix.SetNonblock(fd, true); err == nil {
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

// stop asks the goroutine to finish and waits for it. It returns only after
// the last popped chain has been pushed, so the Queue's LastAvail is exact.
func (rn *runner) stop() {
	rn.stopping.Store(true)
	if rn.kick != nil {
		rn.kick.SetReadDeadline(time.Unix(1, 0)) // wake a blocked read
	}
	<-rn.done
	if rn.kick != nil {
		rn.kick.Close()
	}
}

func (rn *runner) serve() {
	defer close(rn.done)
	// Guest memory is a shared mapping of the front end's file: if the
	// front end shrinks that file, touching it raises SIGBUS. Turn such a
	// fault into a panic of this goroutine, stop the ring and keep the
	// daemon alive.
	debug.SetPanicOnFault(true)
	defer func() {
		if e := recover(); e != nil {
			fault, ok := e.(interface{ Addr() uintptr })
			if !ok {
				panic(e)
			}
			rn.r.log().Error("fault on guest memory; ring stopped", "addr", fmt.Sprintf("%#x", fault.Addr()))
		}
	}()
	r, q := rn.r, rn.q
	chain := virtqueue.NewDescChain(q.Size())
	var kickBuf [8]byte
	for !rn.stopping.Load() {
		rn.drain(chain)
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

// drainBatch is how many chains are served between notification decisions.
const drainBatch = 64

// drain serves available chains until the ring is empty or a stop is asked.
func (rn *runner) drain(chain *virtqueue.DescChain) {
	r, q := rn.r, rn.q
	for n := 0; !rn.stopping.Load(); n++ {
		if n == drainBatch {
			if err := q.Notify(); err != nil {
				r.log().Warn("notify guest", "err", err)
			}
			n = 0
		}
		mem := r.b.memory.Acquire()
		if mem == nil {
			return // memory withdrawn: nothing can be translated
		}
		ok, err := q.Pop(chain, mem)
		if !ok {
			mem.Put()
			if err != nil {
				r.log().Error("ring stopped serving", "err", err)
			}
			return
		}
		switch {
		case err == nil:
			written := r.handler.Serve(chain.Readable, chain.Writable)
			q.Push(chain.Head, written)
		case errors.Is(err, virtqueue.ErrBadChain):
			rn.bad(err)
			q.Push(chain.Head, 0)
		default: // ErrBadHead: nothing to return
			rn.bad(err)
		}
		chain.Release()
		mem.Put()
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
