// Package virtqueue implements the device side of a virtio ring in guest
// memory shared with the daemon, split or packed: it pops available
// descriptor chains, walks and validates every descriptor (direct and
// indirect) into a DescChain of guest memory segments, returns used buffers
// and decides, with EVENT_IDX or the plain suppression flags, when the guest
// must be notified.
//
// The two layouts differ only inside this package. A Queue answers what any
// layout can answer: whether chains wait and how many, an opaque Token to
// return a chain with, and a 32-bit ring base for GET_VRING_BASE (the split
// ring's next avail index; the packed ring's next avail and used indices
// with both wrap counters). The Queue, in this file, holds what both
// layouts share: the size and features, the reference on guest memory,
// dirty logging of the ring's own writes, the producer lock, the first
// notification decision and the call eventfd. Behind it a layout, splitRing
// (split.go) or packedRing (packed.go), owns the rest: its memory areas, its
// indices and the arithmetic on them.
//
// Everything a ring holds is written by an untrusted guest, concurrently
// with the daemon reading it. Each guest value is read once into a local and
// checked before use. A malformed chain whose extent is known is reported
// to the caller as ErrBadChain, to be returned with used length 0, and the
// ring keeps serving later chains; only a ring that leaves no way to know
// which entries are valid (a split avail index moving further than the ring
// size; a packed chain longer than the ring or running into slots the
// driver has not made available) is marked broken until it is set up again.
//
// GuestMemory, the table of mapped memory regions, lives here too because
// chain walking needs it; the vhost-user layer creates and replaces tables.
package virtqueue

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MaxSize is the largest ring the daemon accepts (both layouts' limit).
const MaxSize = 32768

// Descriptor flags, the same bits in both layouts.
const (
	descNext     = 1
	descWrite    = 2
	descIndirect = 4
)

const descSize = 16

// Errors returned by Snapshot and PopSeen. ErrBadChain and ErrBadHead leave
// the ring usable.
var (
	// ErrBadChain: the chain is malformed; the caller returns it to the
	// guest (its DescChain.Token) with used length 0.
	ErrBadChain = errors.New("malformed descriptor chain")
	// ErrBadHead: a split avail entry names no descriptor; it is skipped
	// and cannot be returned to the guest.
	ErrBadHead = errors.New("avail entry out of range")
	// ErrBroken: the ring is unusable until it is set up again.
	ErrBroken = errors.New("ring broken")
)

// Config is what the front end told us about a ring.
type Config struct {
	// Size is the number of entries: a power of two for a split ring,
	// any of 1..MaxSize for a packed one.
	Size uint16
	// Packed selects the packed layout (VIRTIO_F_RING_PACKED). Its three
	// addresses are then the descriptor ring, the driver event area and
	// the device event area.
	Packed bool
	// Front-end virtual addresses (translated with UserSlice).
	DescAddr  uint64
	AvailAddr uint64
	UsedAddr  uint64
	// Base is SET_VRING_BASE's value: the split ring's next avail index
	// (16 bits); for a packed ring bits 0-14 the next avail index, bit 15
	// its wrap counter, bits 16-30 the next used index, bit 31 its wrap
	// counter.
	Base     uint32
	EventIdx bool
	Indirect bool
	// AllowUnmapped accepts buffers outside guest memory as unmapped
	// segments, for the FS_IO bounce through the VMM.
	AllowUnmapped bool
	// Log is the back end's dirty-page log (nil: never logs). While it
	// is active, the ring's own writes are logged when LogUsed is set:
	// the split used ring, or the packed device event area, at
	// UsedLogAddr (SET_VRING_ADDR's log_guest_addr) plus their offset;
	// packed used descriptors at the descriptor ring's guest address.
	Log         *DirtyLog
	LogUsed     bool
	UsedLogAddr uint64
}

// Token names a popped chain to Push: a split ring's head index, or a
// packed ring's buffer id and the slots its chain took. Callers only pass
// it back.
type Token uint64

// Queue is one ring. Snapshot, PopSeen, Seen, Waiting and EnableNotify are
// for one consumer at a time; Push and Notify may run concurrently from
// several goroutines (they serialize on a lock private to this ring).
type Queue struct {
	size          uint16
	eventIdx      bool
	indirect      bool
	allowUnmapped bool

	// ring is the layout, nil once closed: nothing reads the ring's memory
	// any more.
	ring layout

	ringMem *GuestMemory // reference held while the ring is set up

	// Dirty logging of the ring's writes (VHOST_VRING_F_LOG): the front
	// end turns it on and off on a running ring, hence atomics.
	log       *DirtyLog
	usedLogOn atomic.Bool
	usedLog   atomic.Uint64 // guest-physical address of the used ring / device event area

	broken bool // consumer state: set on a fault that leaves no next chain

	// mu guards the layout's producer state (Push, Notify) and decided.
	mu sync.Mutex
	// decided is false until the first notification decision: a new ring
	// does not know what the guest was told before it (a restarted ring, a
	// reconnected daemon), so with EVENT_IDX its first decision signals,
	// as vhost's signalled_used_valid does.
	decided bool
	fence   uint32 // target of the atomic op used as a full barrier

	// callMu guards callFD. Signalling takes it shared and outside mu, so
	// a pusher preempted in the eventfd write (the woken guest thread
	// often takes its CPU) does not hold up the other pushers.
	callMu sync.RWMutex
	callFD int // eventfd to signal the guest, -1 for none
}

// layout is what differs between the split and the packed ring. Each method
// gets the Queue for the state both share. The consumer's methods (seen,
// snapshot, pop, waiting, enableNotify) run on the goroutine that pops;
// push and needNotify run under Queue.mu, as does base.
type layout interface {
	// base is where the ring stands in SET_VRING_BASE's encoding.
	base() uint32
	// seen reports whether chains found by the last snapshot are left.
	seen() bool
	// snapshot looks at what the guest has published; it marks the ring
	// broken when that leaves no way to know which entries are valid.
	snapshot(q *Queue) (bool, error)
	// pop takes the next chain seen into c (reset for it).
	pop(q *Queue, c *DescChain) (bool, error)
	// waiting counts the chains published and not taken, up to limit.
	waiting(q *Queue, limit int) int
	// enableNotify asks for kicks and reports whether chains are pending.
	enableNotify(q *Queue) bool
	// push returns the chain tok names with n bytes written.
	push(q *Queue, tok Token, n uint32)
	// needNotify decides whether what was pushed since the last decision
	// calls for an interrupt.
	needNotify(q *Queue) bool
}

// New validates cfg against mem and returns a ring ready to serve. The ring
// holds a reference on mem (the table its addresses were translated with)
// until Close, so the ring's memory stays mapped even if the front end
// replaces the table.
func New(cfg Config, mem *GuestMemory) (*Queue, error) {
	if mem == nil || !mem.TryGet() {
		return nil, errors.New("no guest memory mapped")
	}
	q := &Queue{size: cfg.Size, eventIdx: cfg.EventIdx, indirect: cfg.Indirect,
		allowUnmapped: cfg.AllowUnmapped, ringMem: mem, callFD: -1}
	q.log = cfg.Log
	if q.log == nil {
		q.log = &neverLog
	}
	q.SetUsedLog(cfg.LogUsed, cfg.UsedLogAddr)
	var err error
	if cfg.Packed {
		q.ring, err = newPackedRing(cfg, mem)
	} else {
		q.ring, err = newSplitRing(cfg, mem)
	}
	if err != nil {
		mem.Put()
		return nil, err
	}
	return q, nil
}

// Close drops the ring's reference on guest memory. The queue must not be
// used afterwards, but for a Push or Notify racing with Close, which does
// nothing.
func (q *Queue) Close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.ringMem != nil {
		q.ring = nil
		q.ringMem.Put()
		q.ringMem = nil
	}
}

// Size returns the number of ring entries.
func (q *Queue) Size() uint16 { return q.size }

// Packed reports whether the ring has the packed layout.
func (q *Queue) Packed() bool {
	_, packed := q.ring.(*packedRing)
	return packed
}

// AllowsUnmapped reports whether chains may hold unmapped segments.
func (q *Queue) AllowsUnmapped() bool { return q.allowUnmapped }

// Broken reports whether the ring stopped on an unrecoverable error.
func (q *Queue) Broken() bool { return q.broken }

// Base returns where the ring stands, in SET_VRING_BASE's encoding (see
// Config.Base): the value GET_VRING_BASE reports once the ring is stopped
// and every chain popped has been pushed.
func (q *Queue) Base() uint32 {
	q.mu.Lock() // a packed ring's used index is producer state
	defer q.mu.Unlock()
	return q.ring.base()
}

// Seen reports whether chains found by the last Snapshot are still to be
// taken by PopSeen.
func (q *Queue) Seen() bool { return q.ring.seen() }

// Waiting returns how many chains the guest has published and the device
// not yet taken, read afresh from the ring, counting no further than limit
// (a packed ring is walked to count them).
func (q *Queue) Waiting(limit int) int {
	if q.broken || limit <= 0 {
		return 0
	}
	return q.ring.waiting(q, limit)
}

// EnableNotify asks the guest to kick when it publishes new chains and
// reports whether chains are already pending (then the caller must keep
// popping instead of sleeping, or a kick would be lost).
func (q *Queue) EnableNotify() bool {
	if q.broken {
		return false
	}
	return q.ring.enableNotify(q)
}

// Snapshot looks at what the guest has published and reports whether
// chains are pending. PopSeen then takes only the chains published up to
// that look, so a caller that acquires the memory table after Snapshot
// translates every chain with a table at least as new as any the front end
// acknowledged before the guest published it (a chain into hot-plugged
// memory is never translated with the table from before the hot-plug).
func (q *Queue) Snapshot() (bool, error) {
	if q.broken {
		return false, ErrBroken
	}
	return q.ring.snapshot(q)
}

// PopSeen takes the next of the chains seen by the last Snapshot into c.
// It returns false with a nil error when none is left. On ErrBadChain the
// chain's Token is in c and must be pushed back (with length 0); on
// ErrBadHead the entry was consumed and there is nothing to push. Without
// guest memory (mem nil) it returns false with an error and consumes
// nothing.
func (q *Queue) PopSeen(c *DescChain, mem *GuestMemory) (bool, error) {
	if q.broken {
		return false, ErrBroken
	}
	if mem == nil {
		return false, errors.New("virtqueue: Pop without guest memory")
	}
	if !q.Seen() {
		return false, nil
	}
	c.reset(mem)
	c.allowUnmapped = q.allowUnmapped
	return q.ring.pop(q, c)
}

// Push returns the chain tok names to the guest with n bytes written into
// its writable buffers. It does not notify; call Notify after a batch.
func (q *Queue) Push(tok Token, n uint32) {
	q.mu.Lock()
	defer q.mu.Unlock() // deferred: a fault on guest memory must not leave it held
	q.push(tok, n)
}

// push is Push under mu.
func (q *Queue) push(tok Token, n uint32) {
	if q.ring == nil {
		return // closed under us: the front end is gone
	}
	q.ring.push(q, tok, n)
}

// Notify signals the guest if it asked to be told about the used entries
// pushed since the last notification.
func (q *Queue) Notify() error {
	q.mu.Lock()
	need := q.needNotify()
	q.mu.Unlock()
	if !need {
		return nil
	}
	return q.signal()
}

// needNotify decides, under mu, whether the entries pushed since the last
// decision call for a notification.
func (q *Queue) needNotify() bool {
	if q.ring == nil {
		return false // closed
	}
	return q.ring.needNotify(q)
}

// SetCall installs a new call eventfd (or -1) and returns the previous one.
// Once it returns no goroutine still signals the old fd, so the caller may
// close it.
func (q *Queue) SetCall(fd int) (old int) {
	q.callMu.Lock()
	old, q.callFD = q.callFD, fd
	q.callMu.Unlock()
	return old
}

// neverLog is the log of a ring whose back end logs nothing.
var neverLog DirtyLog

// SetUsedLog turns the logging of the ring's own writes on or off, with
// the used ring's (packed: device event area's) guest-physical address
// (SET_VRING_ADDR's VHOST_VRING_F_LOG and log_guest_addr). It may be
// called while the ring runs.
func (q *Queue) SetUsedLog(on bool, gpa uint64) {
	q.usedLog.Store(gpa)
	q.usedLogOn.Store(on)
}

// logUsed records a write of n bytes at offset off of the used ring (packed:
// the device event area).
func (q *Queue) logUsed(off, n uint64) {
	if q.log.Active() && q.usedLogOn.Load() {
		q.log.Mark(q.usedLog.Load()+off, n)
	}
}

// LogWritten records the first n bytes of c's writable buffers, the reply
// of used length n, in the dirty log when logging is on. Call it before
// pushing the chain: the used index must not publish a reply whose pages
// are not yet logged.
func (q *Queue) LogWritten(c *DescChain, n uint32) {
	if q.log.Active() {
		q.log.MarkWritten(c.Writable, n)
	}
}

// word32 returns the aligned 32-bit word at b[0:4] for atomic access.
func word32(b []byte) *uint32 { return (*uint32)(unsafe.Pointer(&b[0])) }

// fullBarrier orders earlier stores before later loads (a LOCK'd
// instruction on amd64), as both notification protocols need.
func (q *Queue) fullBarrier() { atomic.AddUint32(&q.fence, 1) }

// signal kicks the guest's call eventfd, if there is one.
func (q *Queue) signal() error {
	q.callMu.RLock()
	defer q.callMu.RUnlock()
	if q.callFD < 0 {
		return nil
	}
	return signal(q.callFD)
}

var one = [8]byte{1}

// signal adds one to an eventfd. The write never blocks (a saturated
// counter answers EAGAIN), so it is issued as a raw syscall: the Go
// scheduler's syscall bookkeeping would let it hand this thread's P to
// another thread whenever the woken guest thread preempts us mid-write,
// and the serving goroutine would then resume on a third thread.
func signal(fd int) error {
	for {
		_, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&one[0])), uintptr(len(one)))
		switch e {
		case 0:
			return nil
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return nil // counter saturated: the guest will see it anyway
		}
		return e
	}
}

// indirectCheck vets an indirect descriptor's table length, the same in
// both layouts: a whole number of 16-byte descriptors, at most the ring's
// size of them (as DPDK and Linux bound it).
func (q *Queue) indirectCheck(n uint32) error {
	switch {
	case !q.indirect:
		return errors.New("indirect descriptor without INDIRECT_DESC")
	case n == 0 || n%descSize != 0:
		return fmt.Errorf("indirect table length %d", n)
	case n/descSize > uint32(q.size):
		return fmt.Errorf("indirect table of %d entries exceeds ring size %d", n/descSize, q.size)
	}
	return nil
}
