// Package virtqueue implements the device side of a virtio split ring in
// guest memory shared with the daemon: it pops available descriptor chains,
// walks and validates every descriptor (direct and indirect) into a
// DescChain of guest memory segments, pushes used entries and decides, with
// EVENT_IDX, when the guest must be notified.
//
// Everything a ring holds is written by an untrusted guest, concurrently
// with the daemon reading it. Each guest value is read once into a local and
// checked before use; a malformed chain is reported to the caller as an
// error (the ring keeps serving later chains), and only an avail index that
// moves further than the ring size, which leaves no way to know which
// entries are valid, marks the ring broken.
//
// GuestMemory, the table of mapped memory regions, lives here too because
// chain walking needs it; the vhost-user layer creates and replaces tables.
package virtqueue

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MaxSize is the largest ring the daemon accepts (the split ring limit).
const MaxSize = 32768

// Descriptor flags.
const (
	descNext     = 1
	descWrite    = 2
	descIndirect = 4
)

const descSize = 16

// Ring flags.
const (
	availNoInterrupt = 1
)

// Errors returned by Pop. ErrBadChain and ErrBadHead leave the ring usable.
var (
	// ErrBadChain: the chain at Head is malformed; the caller returns it to
	// the guest with used length 0.
	ErrBadChain = errors.New("malformed descriptor chain")
	// ErrBadHead: the avail entry names no descriptor; it is skipped and
	// cannot be returned to the guest.
	ErrBadHead = errors.New("avail entry out of range")
	// ErrBroken: the ring is unusable until it is set up again.
	ErrBroken = errors.New("ring broken")
)

// Config is what the front end told us about a ring.
type Config struct {
	Size      uint16 // number of entries, a power of two
	DescAddr  uint64 // front-end virtual addresses (translated with UserSlice)
	AvailAddr uint64
	UsedAddr  uint64
	// AvailBase is the index of the first avail entry to process
	// (SET_VRING_BASE).
	AvailBase uint16
	EventIdx  bool
	Indirect  bool
	// AllowUnmapped accepts buffers outside guest memory as unmapped
	// segments, for the FS_IO bounce through the VMM.
	AllowUnmapped bool
	// Log is the back end's dirty-page log (nil: never logs). While it
	// is active, the ring's writes into the used ring are logged when
	// LogUsed is set, at UsedLogAddr (the used ring's guest-physical
	// address, SET_VRING_ADDR's log_guest_addr) plus their offset.
	Log         *DirtyLog
	LogUsed     bool
	UsedLogAddr uint64
}

// Queue is one split ring. Pop is for a single consumer goroutine; Push and
// Notify may run concurrently from several goroutines (they serialize on a
// lock private to this ring).
type Queue struct {
	size          uint16
	eventIdx      bool
	indirect      bool
	allowUnmapped bool

	ringMem *GuestMemory // reference held while the ring is set up
	desc    []byte
	avail   []byte
	used    []byte

	// Dirty logging of the used ring (VHOST_VRING_F_LOG): the front end
	// turns it on and off on a running ring, hence atomics.
	log       *DirtyLog
	usedLogOn atomic.Bool
	usedLog   atomic.Uint64 // guest-physical address of the used ring

	// Consumer state (Pop).
	lastAvail uint16
	seenAvail uint16 // avail.idx at the last Snapshot
	broken    bool

	// Producer state (Push/Notify), guarded by mu.
	mu        sync.Mutex
	usedIdx   uint16
	signalled uint16 // used index at the last notification decision
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

// New validates cfg against mem and returns a ring ready to serve. The ring
// holds a reference on mem (the table its addresses were translated with)
// until Close, so the ring's memory stays mapped even if the front end
// replaces the table. The used index is read back from the ring.
func New(cfg Config, mem *GuestMemory) (*Queue, error) {
	n := uint64(cfg.Size)
	if n == 0 || n > MaxSize || n&(n-1) != 0 {
		return nil, fmt.Errorf("ring size %d is not a power of two in 1..%d", n, MaxSize)
	}
	if cfg.DescAddr%16 != 0 || cfg.AvailAddr%2 != 0 || cfg.UsedAddr%4 != 0 {
		return nil, fmt.Errorf("ring addresses desc %#x avail %#x used %#x misaligned", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr)
	}
	if mem == nil || !mem.TryGet() {
		return nil, errors.New("no guest memory mapped")
	}
	q := &Queue{size: cfg.Size, eventIdx: cfg.EventIdx, indirect: cfg.Indirect, allowUnmapped: cfg.AllowUnmapped, ringMem: mem, callFD: -1}
	q.log = cfg.Log
	if q.log == nil {
		q.log = &neverLog
	}
	q.SetUsedLog(cfg.LogUsed, cfg.UsedLogAddr)
	var ok1, ok2, ok3 bool
	q.desc, ok1 = mem.UserSlice(cfg.DescAddr, descSize*n)
	q.avail, ok2 = mem.UserSlice(cfg.AvailAddr, 6+2*n)
	q.used, ok3 = mem.UserSlice(cfg.UsedAddr, 6+8*n)
	if !ok1 || !ok2 || !ok3 {
		mem.Put()
		return nil, fmt.Errorf("ring desc %#x avail %#x used %#x (size %d) not inside one mapped region each", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr, n)
	}
	q.lastAvail = cfg.AvailBase
	q.seenAvail = cfg.AvailBase // nothing seen yet
	q.usedIdx = q.loadUsedIdx()
	q.signalled = q.usedIdx
	return q, nil
}

// Close drops the ring's reference on guest memory. The queue must not be
// used afterwards.
func (q *Queue) Close() {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.ringMem != nil {
		q.desc, q.avail, q.used = nil, nil, nil
		q.ringMem.Put()
		q.ringMem = nil
	}
}

// Size returns the number of ring entries.
func (q *Queue) Size() uint16 { return q.size }

// AllowsUnmapped reports whether chains may hold unmapped segments.
func (q *Queue) AllowsUnmapped() bool { return q.allowUnmapped }

// LastAvail returns the index of the next avail entry Pop will take: the
// value GET_VRING_BASE reports once the ring is stopped.
func (q *Queue) LastAvail() uint16 { return q.lastAvail }

// SeenAvail is the avail index read by the last Snapshot: the chains
// between LastAvail and it are published but not yet taken.
func (q *Queue) SeenAvail() uint16 { return q.seenAvail }

// Broken reports whether the ring stopped on an unrecoverable error.
func (q *Queue) Broken() bool { return q.broken }

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

// SetUsedLog turns the logging of used-ring writes on or off, with the used
// ring's guest-physical address (SET_VRING_ADDR's VHOST_VRING_F_LOG and
// log_guest_addr). It may be called while the ring runs.
func (q *Queue) SetUsedLog(on bool, gpa uint64) {
	q.usedLog.Store(gpa)
	q.usedLogOn.Store(on)
}

// logUsed records a write of n bytes at offset off of the used ring.
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

// availEventOffset is where avail_event sits in the used ring.
func (q *Queue) availEventOffset() int { return 4 + 8*int(q.size) }

// word32 returns the aligned 32-bit word at b[0:4] for atomic access.
func word32(b []byte) *uint32 { return (*uint32)(unsafe.Pointer(&b[0])) }

// loadAvailIdx reads avail.idx with acquire semantics: entries it covers are
// read after it. The {flags, idx} pair is read as one 32-bit word (Go has no
// 16-bit atomics); on amd64 a 2-aligned 4-byte load never tears a 16-bit half.
func (q *Queue) loadAvailIdx() uint16 {
	return uint16(atomic.LoadUint32(word32(q.avail)) >> 16)
}

func (q *Queue) loadAvailFlags() uint16 {
	return uint16(atomic.LoadUint32(word32(q.avail)))
}

func (q *Queue) loadUsedIdx() uint16 {
	return uint16(atomic.LoadUint32(word32(q.used)) >> 16)
}

// fullBarrier orders earlier stores before later loads (a LOCK'd
// instruction on amd64), as the EVENT_IDX protocol needs.
func (q *Queue) fullBarrier() { atomic.AddUint32(&q.fence, 1) }

// Pending reports whether the guest has published chains not yet popped.
func (q *Queue) Pending() bool { return !q.broken && q.loadAvailIdx() != q.lastAvail }

// Waiting returns how many chains the guest has published and the device
// not yet taken, read afresh from the ring (at most the ring's size: a
// bad index is Snapshot's to report).
func (q *Queue) Waiting() int {
	if q.broken {
		return 0
	}
	return int(min(q.loadAvailIdx()-q.lastAvail, q.size))
}

// EnableNotify asks the guest to kick when it publishes new chains and
// reports whether chains are already pending (then the caller must keep
// popping instead of sleeping, or a kick would be lost).
func (q *Queue) EnableNotify() bool {
	if q.broken {
		return false
	}
	if q.eventIdx {
		off := q.availEventOffset()
		binary.LittleEndian.PutUint16(q.used[off:], q.lastAvail)
		q.logUsed(uint64(off), 2)
	}
	q.fullBarrier()
	return q.loadAvailIdx() != q.lastAvail
}

// Pop takes the next available chain into c. It returns false with a nil
// error when the ring is empty. On ErrBadChain the chain's head is in
// c.Head and must be pushed back (with length 0); on ErrBadHead the entry
// was consumed and there is nothing to push. Without guest memory (mem nil)
// it returns false with an error and consumes nothing.
func (q *Queue) Pop(c *DescChain, mem *GuestMemory) (bool, error) {
	if q.broken {
		return false, ErrBroken
	}
	if mem == nil {
		// Nothing to translate buffers with: leave the entry for later.
		return false, errors.New("virtqueue: Pop without guest memory")
	}
	if _, err := q.Snapshot(); err != nil {
		return false, err
	}
	return q.PopSeen(c, mem)
}

// Snapshot reads avail.idx and reports whether chains are pending. PopSeen
// then takes only the chains published up to that read, so a caller that
// acquires the memory table after Snapshot translates every chain with a
// table at least as new as any the front end acknowledged before the guest
// published it (a chain into hot-plugged memory is never translated with
// the table from before the hot-plug).
func (q *Queue) Snapshot() (bool, error) {
	if q.broken {
		return false, ErrBroken
	}
	availIdx := q.loadAvailIdx()
	pending := availIdx - q.lastAvail
	if pending > q.size {
		q.broken = true
		return false, fmt.Errorf("%w: avail index %d is %d entries past %d, ring has %d", ErrBroken, availIdx, pending, q.lastAvail, q.size)
	}
	q.seenAvail = availIdx
	return pending != 0, nil
}

// PopSeen is Pop limited to the chains seen by the last Snapshot.
func (q *Queue) PopSeen(c *DescChain, mem *GuestMemory) (bool, error) {
	if q.broken {
		return false, ErrBroken
	}
	if mem == nil {
		return false, errors.New("virtqueue: Pop without guest memory")
	}
	if q.seenAvail == q.lastAvail {
		return false, nil
	}
	slot := int(q.lastAvail & (q.size - 1))
	head := binary.LittleEndian.Uint16(q.avail[4+2*slot:])
	q.lastAvail++
	if q.eventIdx {
		// Let the guest skip kicks for what we are about to see anyway.
		off := q.availEventOffset()
		binary.LittleEndian.PutUint16(q.used[off:], q.lastAvail)
		q.logUsed(uint64(off), 2)
	}
	c.reset(head, mem)
	c.allowUnmapped = q.allowUnmapped
	if head >= q.size {
		return true, fmt.Errorf("%w: head %d, ring size %d", ErrBadHead, head, q.size)
	}
	if err := q.walk(c); err != nil {
		return true, fmt.Errorf("%w: head %d: %v", ErrBadChain, head, err)
	}
	return true, nil
}

// desc reads descriptor i of table t (16-byte entries) once.
type descriptor struct {
	addr  uint64
	len   uint32
	flags uint16
	next  uint16
}

func readDesc(t []byte, i int) descriptor {
	b := t[i*descSize : i*descSize+descSize]
	return descriptor{
		addr:  binary.LittleEndian.Uint64(b[0:]),
		len:   binary.LittleEndian.Uint32(b[8:]),
		flags: binary.LittleEndian.Uint16(b[12:]),
		next:  binary.LittleEndian.Uint16(b[14:]),
	}
}

// walk follows the chain at c.Head, appending its buffers to c. Every step
// is bounded: a chain visits at most as many descriptors as its table holds,
// which also catches loops.
func (q *Queue) walk(c *DescChain) error {
	table := q.desc
	entries := int(q.size)
	idx := int(c.Head)
	seen := 0
	inIndirect := false
	for {
		if idx >= entries {
			return fmt.Errorf("descriptor index %d beyond table of %d", idx, entries)
		}
		seen++
		if seen > entries {
			return fmt.Errorf("chain longer than its table of %d (loop?)", entries)
		}
		d := readDesc(table, idx)
		if d.flags&descIndirect != 0 {
			switch {
			case !q.indirect:
				return errors.New("indirect descriptor without INDIRECT_DESC")
			case inIndirect:
				return errors.New("indirect descriptor inside an indirect table")
			case d.flags&descNext != 0:
				return errors.New("indirect descriptor with NEXT set")
			case d.len == 0 || d.len%descSize != 0:
				return fmt.Errorf("indirect table length %d", d.len)
			case d.len/descSize > uint32(q.size):
				return fmt.Errorf("indirect table of %d entries exceeds ring size %d", d.len/descSize, q.size)
			}
			t, err := c.indirectTable(d.addr, d.len)
			if err != nil {
				return err
			}
			table, entries, idx, seen, inIndirect = t, int(d.len/descSize), 0, 0, true
			continue
		}
		if err := c.addBuffer(d.addr, d.len, d.flags&descWrite != 0); err != nil {
			return err
		}
		if d.flags&descNext == 0 {
			return nil
		}
		idx = int(d.next)
	}
}

// Push returns chain head to the guest with n bytes written into its
// writable buffers. It does not notify; call Notify after a batch.
func (q *Queue) Push(head uint16, n uint32) {
	q.mu.Lock()
	defer q.mu.Unlock() // deferred: a fault on guest memory must not leave it held
	q.push(head, n)
}

func (q *Queue) push(head uint16, n uint32) {
	if q.used == nil {
		return // closed under us: the front end is gone
	}
	slot := int(q.usedIdx & (q.size - 1))
	off := 4 + 8*slot
	e := q.used[off:]
	binary.LittleEndian.PutUint32(e[0:], uint32(head))
	binary.LittleEndian.PutUint32(e[4:], n)
	q.logUsed(uint64(off), 8)
	q.usedIdx++
	// Entries before index: the atomic store is a release (and on amd64 a
	// full barrier, which the EVENT_IDX check in notify relies on). The
	// device owns used.flags, which we keep at 0 (and write with the
	// index: they share the word).
	atomic.StoreUint32(word32(q.used), uint32(q.usedIdx)<<16)
	q.logUsed(0, 4)
}

// PushNotify pushes one chain and signals the guest if it asked for it.
func (q *Queue) PushNotify(head uint16, n uint32) error {
	if !q.pushDecide(head, n) {
		return nil
	}
	return q.signal()
}

func (q *Queue) pushDecide(head uint16, n uint32) bool {
	q.mu.Lock()
	defer q.mu.Unlock() // deferred: a fault on guest memory must not leave it held
	q.push(head, n)
	return q.needNotify()
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
	if q.used == nil {
		return false
	}
	old, cur := q.signalled, q.usedIdx
	if old == cur {
		return false
	}
	q.fullBarrier()
	var need bool
	if q.eventIdx {
		usedEvent := binary.LittleEndian.Uint16(q.avail[4+2*int(q.size):])
		need = cur-usedEvent-1 < cur-old || !q.decided
	} else {
		need = q.loadAvailFlags()&availNoInterrupt == 0
	}
	q.signalled, q.decided = cur, true
	return need
}

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
