package vhostuser

import (
	"errors"
	"log/slog"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// vring is the daemon's view of one virtqueue: what the front end configured
// and, once the ring is started (SET_VRING_KICK) and enabled, the runner
// whose server goroutines serve it.
//
// Configuration fields are touched only by the message loop. The runner
// owns the Queue's consumer side while it runs; the message loop stops it
// (and waits) before it touches the Queue again.
type vring struct {
	index int
	b     *Backend

	num     uint16
	addr    vringAddr
	hasAddr bool
	base    uint32 // SET_VRING_BASE's value (virtqueue.Config.Base)
	baseSet bool   // base was given (or kept by a stop) since the last reset
	enabled bool

	kickFD int // -1: none received yet
	callFD int // the fd we own; the Queue signals it under its lock
	errFD  int

	queue *virtqueue.Queue // non-nil while started
	slots []*slot          // request state per server, made on first need, kept across stop/start while the size holds

	run     *runner // non-nil while the ring is served
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
	packed := r.b.acked&featRingPacked != 0
	if packed && !r.baseSet {
		// A front end that sends no base starts where the spec starts
		// a packed ring: indices 0, both wrap counters 1.
		r.base = 1<<15 | 1<<31
	}
	var q *virtqueue.Queue
	err := faultSafe(func() (err error) { // New reads the ring: it may fault (runner.go, faultSafe)
		q, err = r.newQueue(mem, packed)
		return err
	})
	if err != nil {
		return err
	}
	q.SetCall(r.callFD)
	r.queue = q
	if n := r.index + 1; n > r.b.watched { // rings 0 to n-1 may have a watcher
		r.b.watched = n
		if r.b.cfg.RingsWatched != nil {
			r.b.cfg.RingsWatched(n)
		}
	}
	if len(r.slots) > 0 && r.slots[0].chain.Cap() != int(r.num) {
		r.slots = nil // a new queue size: each server makes its slot again
	}
	r.b.log.Debug("ring started", "queue", r.index, "size", r.num, "base", r.base, "packed", q.Packed(),
		"event_idx", r.b.acked&featEventIdx != 0, "indirect", r.b.acked&featIndirectDesc != 0)
	return nil
}

// newQueue makes the Queue of the configuration.
func (r *vring) newQueue(mem *virtqueue.GuestMemory, packed bool) (*virtqueue.Queue, error) {
	return virtqueue.New(virtqueue.Config{
		Size:      r.num,
		DescAddr:  r.addr.desc,
		AvailAddr: r.addr.avail,
		UsedAddr:  r.addr.used,
		Packed:    packed,
		Base:      r.base,
		EventIdx:  r.b.acked&featEventIdx != 0,
		Indirect:  r.b.acked&featIndirectDesc != 0,
		// Buffers outside guest memory (a DAX window) can be bounced
		// through the VMM only over a negotiated back-end channel.
		AllowUnmapped: r.b.channel.bounceUsable(),
		Log:           &r.b.dirty,
		LogUsed:       r.addr.flags&vringFlagLog != 0,
		UsedLogAddr:   r.addr.logGPA,
	}, mem)
}

// resume starts serving the ring if it is started and enabled.
func (r *vring) resume() {
	if r.run != nil || r.queue == nil || !r.enabled || r.queue.Broken() {
		return
	}
	r.run = startRunner(r, r.queue, r.kickFD)
	r.b.checkWorkers()
}

// pause stops serving the ring and waits until every chain its servers
// popped has been completed and pushed.
func (r *vring) pause() {
	if r.run == nil {
		return
	}
	defer r.b.checkWorkers()
	defer func() { r.run = nil }() // even if the stop faulted (Backend.Serve)
	r.run.stop()
}

// stop pauses the ring, records where it stopped and releases its Queue: the
// GET_VRING_BASE semantics.
func (r *vring) stop() uint32 {
	r.pause()
	if r.queue != nil {
		r.base, r.baseSet = r.queue.Base(), true
		r.queue.Close()
		r.queue = nil
	}
	if r.kickFD >= 0 {
		unix.Close(r.kickFD)
		r.kickFD = -1
	}
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
	r.num, r.base, r.baseSet, r.enabled, r.hasAddr = 0, 0, false, false, false
	r.addr = vringAddr{}
}

// slot is one server's request state: the chain it serves and the
// RequestHandler made for it (Config.Handler). A ring's slots are made once
// per queue size, the first time each server runs, and kept across stop
// and start (vring.slots).
type slot struct {
	chain    *virtqueue.DescChain
	handler  RequestHandler
	classify Classifier // nil: every request is cheap and quick
}

func (r *vring) newSlot() *slot {
	h := r.b.cfg.Handler.QueueHandler(r.index)
	c, _ := h.(Classifier)
	return &slot{chain: virtqueue.NewDescChain(r.num), handler: h, classify: c}
}
