package vmm

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Desc is one split-ring descriptor: {le64 addr, le32 len, le16 flags,
// le16 next}. Packed rings have PackedDesc.
type Desc struct {
	Addr  uint64
	Len   uint32
	Flags uint16
	Next  uint16
}

// DescSize is the size of a descriptor in the table (split or packed).
const DescSize = 16

// Descriptor flags.
const (
	DescNext     = 1
	DescWrite    = 2
	DescIndirect = 4
)

// Ring flags: the driver's VRING_AVAIL_F_NO_INTERRUPT and the device's
// VRING_USED_F_NO_NOTIFY.
const (
	AvailNoInterrupt = 1
	UsedNoNotify     = 1
)

// RingAddrs places the three parts of a ring (guest-physical): for a
// packed ring Avail is the driver event area and Used the device event
// area, as in SET_VRING_ADDR.
type RingAddrs struct{ Desc, Avail, Used uint64 }

// Completion is one used-ring element.
type Completion struct{ ID, Len uint32 }

// KickMode chooses when the driver writes the kick eventfd.
type KickMode int

const (
	// KickAuto kicks as Linux does: after publishing, only if the device
	// asked for it (avail_event with EVENT_IDX, else !VRING_USED_F_NO_NOTIFY).
	KickAuto KickMode = iota
	// KickAlways kicks after every publication.
	KickAlways
	// KickManual never kicks by itself; the test calls Queue.Kick.
	KickManual
)

// NotifyMode chooses how completions are noticed.
type NotifyMode int

const (
	// NotifyInterrupt collects used elements only when the back end signals
	// the current call eventfd, as a guest does: a missing notification is
	// a timeout whose error says that used.idx had moved.
	NotifyInterrupt NotifyMode = iota
	// NotifyPoll also polls used.idx every millisecond.
	NotifyPoll
)

// staleGrace is how long signals on a call fd that has just been replaced
// are still honoured: the back end may have signalled it before it read the
// new SET_VRING_CALL. Later signals there are counted as lost interrupts.
const staleGrace = time.Second

// Errors a Chain can end with.
var (
	ErrAbandoned = errors.New("vmm: chain abandoned by a ring reset")
	ErrClosed    = errors.New("vmm: queue closed")
	ErrRingFull  = errors.New("vmm: not enough free descriptors")
)

// QueueConfig configures a Queue.
type QueueConfig struct {
	Size       uint16     // number of descriptors
	EventIdx   bool       // VIRTIO_RING_F_EVENT_IDX was negotiated
	Indirect   bool       // VIRTIO_RING_F_INDIRECT_DESC was negotiated
	Kick       KickMode   // when to kick
	Notify     NotifyMode // how to notice completions
	Addrs      RingAddrs  // where to put the ring; zero: allocate
	RingRegion int        // region to allocate the ring in (<0: any)
	BufRegion  int        // region for request buffers (<0: any)
	QuietKick  bool       // create kick eventfds at 0 (QEMU creates them at 1)
	Packed     bool       // VIRTIO_F_RING_PACKED: a packed ring (packed.go); Size need not be a power of 2
}

// Queue is the driver side of one virtqueue, split or packed. The methods
// tests use to submit and collect requests work on both layouts; the raw
// accessors of one layout panic on the other.
type Queue struct {
	Index int
	mem   *Memory
	cfg   QueueConfig

	mu         sync.Mutex
	addrs      RingAddrs
	desc       []byte // descriptor table (packed: descriptor ring), Size*16 bytes
	avail      []byte // avail ring incl. used_event (packed: driver event area)
	used       []byte // used ring incl. avail_event (packed: device event area)
	free       []uint16
	availIdx   uint16 // shadow of avail.idx
	numAdded   uint16 // published since the last kick decision (packed: slots)
	lastUsed   uint16
	pk         packedState       // packed rings only
	inflight   map[uint32]*Chain // by head (packed: by buffer id)
	history    []Completion
	violations []string
	kicks      int
	irqs       int
	lost       int // signals on stale call fds after the grace period

	kickFd  int
	callFd  int
	stale   []staleFd
	errFd   int
	wakeFd  int
	closed  bool
	irqDone chan struct{}

	// packed is cfg.Packed, readable without q.mu: the split accessors
	// that check it run both with and without the lock held.
	packed atomic.Bool
}

type staleFd struct {
	fd    int
	since time.Time
}

func eventfd(initval uint) (int, error) {
	return unix.Eventfd(initval, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
}

// NewQueue lays out a zeroed ring in mem and starts the queue's
// interrupt handler.
func NewQueue(mem *Memory, index int, cfg QueueConfig) (*Queue, error) {
	if cfg.Size == 0 {
		return nil, errors.New("vmm: queue size 0")
	}
	if cfg.Packed && int(cfg.Size) > MaxPackedSize {
		return nil, fmt.Errorf("vmm: packed ring of %d entries (at most %d)", cfg.Size, MaxPackedSize)
	}
	q := &Queue{Index: index, mem: mem, cfg: cfg, inflight: map[uint32]*Chain{},
		kickFd: -1, callFd: -1, errFd: -1, wakeFd: -1, irqDone: make(chan struct{})}
	q.packed.Store(cfg.Packed)
	if err := q.layout(cfg.Addrs); err != nil {
		return nil, err
	}
	q.resetFree()
	var err error
	for _, p := range []*int{&q.callFd, &q.errFd, &q.wakeFd} {
		if *p, err = eventfd(0); err != nil {
			q.closeFds()
			return nil, err
		}
	}
	go q.irqLoop()
	return q, nil
}

// RingBytes returns the sizes of the descriptor table, avail ring and used
// ring of a split ring of n entries (with EVENT_IDX fields); PackedRingBytes
// sizes a packed one.
func RingBytes(n uint16) (desc, avail, used uint64) {
	return uint64(n) * DescSize, 6 + 2*uint64(n), 6 + 8*uint64(n)
}

// layout allocates the ring (as Linux's vring_init does: one page-aligned
// block, used ring aligned to 64 bytes) or adopts the given addresses.
func (q *Queue) layout(a RingAddrs) error {
	if q.cfg.Packed {
		return q.layoutPacked(a)
	}
	n := q.cfg.Size
	dl, al, ul := RingBytes(n)
	if a == (RingAddrs{}) {
		usedOff := (dl + al + 63) &^ 63
		// 4 bytes of slack so that the aligned 32-bit word holding
		// avail_event never reaches past our allocation.
		base, err := q.mem.AllocIn(q.cfg.RingRegion, usedOff+ul+4, PageSize)
		if err != nil {
			return err
		}
		a = RingAddrs{base, base + dl, base + usedOff}
	}
	var err error
	if q.desc, err = q.mem.Slice(a.Desc, dl); err != nil {
		return err
	}
	if q.avail, err = q.mem.Slice(a.Avail, al); err != nil {
		return err
	}
	if q.used, err = q.mem.Slice(a.Used, ul); err != nil {
		return err
	}
	if a.Avail%2 != 0 || a.Used%4 != 0 || a.Desc%16 != 0 {
		return fmt.Errorf("vmm: misaligned ring %+v", a)
	}
	q.addrs = a
	return nil
}

func (q *Queue) resetFree() {
	if q.cfg.Packed {
		q.resetPacked()
		return
	}
	n := int(q.cfg.Size)
	q.free = q.free[:0]
	for i := n - 1; i >= 0; i-- {
		q.free = append(q.free, uint16(i))
	}
}

// Config returns the queue's configuration.
func (q *Queue) Config() QueueConfig {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.cfg
}

// Size is the number of descriptors.
func (q *Queue) Size() uint16 { return q.cfg.Size }

// Addrs returns the guest-physical ring addresses.
func (q *Queue) Addrs() RingAddrs {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.addrs
}

// VringAddr returns the SET_VRING_ADDR payload QEMU would send: HVAs of
// the three parts, and the used ring's GPA as the log address (packed: the
// device event area's, QEMU's used_phys).
func (q *Queue) VringAddr() (VringAddr, error) {
	a := q.Addrs()
	d, err1 := q.mem.HVA(a.Desc)
	av, err2 := q.mem.HVA(a.Avail)
	u, err3 := q.mem.HVA(a.Used)
	if err := errors.Join(err1, err2, err3); err != nil {
		return VringAddr{}, err
	}
	return VringAddr{Index: uint32(q.Index), Desc: d, Avail: av, Used: u, Log: a.Used}, nil
}

// ---- 16-bit ring fields through aligned 32-bit atomics ----

// word returns the aligned 32-bit word of guest memory holding the 16-bit
// field at b[off], and the field's bit shift inside it. The word may begin
// before b (a 2-aligned avail ring) or end after it: rings are allocated
// with slack, and guest memory is one mapping per memfd.
func word(b []byte, off int) (*uint32, uint) {
	p := unsafe.Pointer(&b[off])
	mis := int(uintptr(p) & 3)
	return (*uint32)(unsafe.Add(p, -mis)), uint(mis) * 8
}

func load16(b []byte, off int) uint16 {
	w, shift := word(b, off)
	return uint16(atomic.LoadUint32(w) >> shift)
}

// store16 changes only the 16 bits at b[off], even if the other half of
// the word is concurrently written by the device.
func store16(b []byte, off int, v uint16) {
	w, shift := word(b, off)
	for {
		old := atomic.LoadUint32(w)
		nw := old&^(0xffff<<shift) | uint32(v)<<shift
		if atomic.CompareAndSwapUint32(w, old, nw) {
			return
		}
	}
}

// AvailIdx is the avail.idx published so far.
func (q *Queue) AvailIdx() uint16 {
	q.splitOnly("AvailIdx")
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.availIdx
}

// UsedIdx reads used.idx from guest memory.
func (q *Queue) UsedIdx() uint16 {
	q.splitOnly("UsedIdx")
	return load16(q.used, 2)
}

// UsedFlags reads used.flags from guest memory.
func (q *Queue) UsedFlags() uint16 {
	q.splitOnly("UsedFlags")
	return load16(q.used, 0)
}

// AvailEvent reads avail_event (the device's kick threshold, EVENT_IDX).
func (q *Queue) AvailEvent() uint16 {
	q.splitOnly("AvailEvent")
	return load16(q.used, 4+8*int(q.cfg.Size))
}

// UsedEvent reads used_event (our interrupt threshold, EVENT_IDX).
func (q *Queue) UsedEvent() uint16 {
	q.splitOnly("UsedEvent")
	return load16(q.avail, 4+2*int(q.cfg.Size))
}

// SetUsedEvent writes used_event.
func (q *Queue) SetUsedEvent(v uint16) {
	q.splitOnly("SetUsedEvent")
	store16(q.avail, 4+2*int(q.cfg.Size), v)
}

// SetAvailFlags writes avail.flags (e.g. AvailNoInterrupt).
func (q *Queue) SetAvailFlags(f uint16) {
	q.splitOnly("SetAvailFlags")
	store16(q.avail, 0, f)
}

// LastUsed is the used index up to which completions were collected.
func (q *Queue) LastUsed() uint16 {
	q.splitOnly("LastUsed")
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.lastUsed
}

// ---- raw descriptor access, for building any chain, well formed or not ----

// WriteDesc writes descriptor i of the table (i < Size).
func (q *Queue) WriteDesc(i uint16, d Desc) {
	q.splitOnly("WriteDesc")
	b := q.desc[int(i)*DescSize:]
	le.PutUint64(b, d.Addr)
	le.PutUint32(b[8:], d.Len)
	le.PutUint16(b[12:], d.Flags)
	le.PutUint16(b[14:], d.Next)
}

// ReadDesc reads descriptor i of the table.
func (q *Queue) ReadDesc(i uint16) Desc {
	q.splitOnly("ReadDesc")
	b := q.desc[int(i)*DescSize:]
	return Desc{le.Uint64(b), le.Uint32(b[8:]), le.Uint16(b[12:]), le.Uint16(b[14:])}
}

// EncodeDescs encodes descriptors as a table (for indirect tables).
func EncodeDescs(ds []Desc) []byte {
	var b []byte
	for _, d := range ds {
		b = le.AppendUint64(b, d.Addr)
		b = le.AppendUint32(b, d.Len)
		b = le.AppendUint16(b, d.Flags)
		b = le.AppendUint16(b, d.Next)
	}
	return b
}

// WriteTable writes an indirect descriptor table at gpa (which may straddle
// GPA-contiguous regions).
func (q *Queue) WriteTable(gpa uint64, ds []Desc) error {
	q.splitOnly("WriteTable")
	return q.mem.WriteAt(EncodeDescs(ds), gpa)
}

// AllocDescs takes n descriptor slots off the free list, for the caller to
// fill with WriteDesc and submit with AddRaw.
func (q *Queue) AllocDescs(n int) ([]uint16, error) {
	q.splitOnly("AllocDescs")
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.allocDescs(n)
}

func (q *Queue) allocDescs(n int) ([]uint16, error) {
	if n > len(q.free) {
		return nil, ErrRingFull
	}
	ids := make([]uint16, n)
	for i := range ids {
		ids[i] = q.free[len(q.free)-1]
		q.free = q.free[:len(q.free)-1]
	}
	return ids, nil
}

// FreeDescs returns descriptor slots to the free list.
func (q *Queue) FreeDescs(ids []uint16) {
	q.splitOnly("FreeDescs")
	q.mu.Lock()
	defer q.mu.Unlock()
	q.freeDescs(ids)
}

func (q *Queue) freeDescs(ids []uint16) {
	for i := len(ids) - 1; i >= 0; i-- {
		q.free = append(q.free, ids[i])
	}
}

// NumFree is the number of free descriptors (packed: free slots).
func (q *Queue) NumFree() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.cfg.Packed {
		return q.pk.freeSlots
	}
	return len(q.free)
}

// WriteAvailSlot writes avail.ring[slot % Size] = head without publishing.
func (q *Queue) WriteAvailSlot(slot, head uint16) {
	q.splitOnly("WriteAvailSlot")
	le.PutUint16(q.avail[4+2*int(slot%q.cfg.Size):], head)
}

// SetAvailIdx publishes an arbitrary avail.idx (e.g. one jumping by more
// than Size) and makes it the driver's shadow index.
func (q *Queue) SetAvailIdx(idx uint16) {
	q.splitOnly("SetAvailIdx")
	q.mu.Lock()
	defer q.mu.Unlock()
	q.numAdded += idx - q.availIdx
	q.availIdx = idx
	q.publish()
}

// publish stores {avail.flags, avail.idx} with one atomic 32-bit store:
// every descriptor and ring entry written before it is visible to the
// device once it sees the new index.
func (q *Queue) publish() {
	w, _ := word(q.avail, 0)
	flags := atomic.LoadUint32(w) & 0xffff
	atomic.StoreUint32(w, flags|uint32(q.availIdx)<<16)
}

// Chain is a descriptor chain made available to the device.
type Chain struct {
	q     *Queue
	Head  uint32 // the id the device must return (may be >= Size for malformed tests); packed: the buffer id
	descs []uint16
	table uint64 // GPA of our indirect table, 0 if none

	// Packed rings only.
	slots  int       // ring slots the chain takes: the device's used index moves by this much
	wlen   uint32    // writable bytes: no used len may exceed it
	sameID *Chain    // the next chain in flight under the same id (BadDuplicateID)
	orig   *FuseCall // for BadDuplicateID: the valid chain whose id this one reuses

	done    chan struct{}
	usedLen uint32
	err     error
}

// Segment is one guest buffer of a chain.
type Segment struct {
	Addr  uint64
	Len   uint32
	Write bool // device-writable
}

// IndirectMode chooses between a direct chain and one indirect descriptor.
type IndirectMode int

const (
	// IndirectAuto does what Linux does: one indirect descriptor when
	// INDIRECT_DESC is negotiated and the chain has more than one segment.
	IndirectAuto IndirectMode = iota
	// IndirectNever always builds a direct chain (Linux's fallback when it
	// cannot allocate a table).
	IndirectNever
	// IndirectAlways uses an indirect descriptor even for one segment or
	// when the feature was not negotiated (a negative test).
	IndirectAlways
)

func (q *Queue) useIndirect(m IndirectMode, n int) bool {
	switch m {
	case IndirectAlways:
		return true
	case IndirectNever:
		return false
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.cfg.Indirect && n > 1
}

// SetBufRegion moves future request buffers and indirect tables to region
// i (<0: any region), e.g. into a hot-plugged region.
func (q *Queue) SetBufRegion(i int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.cfg.BufRegion = i
}

func (q *Queue) bufRegion() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.cfg.BufRegion
}

// SetNegotiated tells the driver which ring features were negotiated.
func (q *Queue) SetNegotiated(eventIdx, indirect bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.cfg.EventIdx, q.cfg.Indirect = eventIdx, indirect
}

// Add builds a chain over segs, in the given order (no readable-before-
// writable check, so a test can build the bad order), and publishes it.
// It does not kick: call Notify (or use Submit).
func (q *Queue) Add(segs []Segment, mode IndirectMode) (*Chain, error) {
	if len(segs) == 0 {
		return nil, errors.New("vmm: empty chain")
	}
	if q.Packed() {
		return q.addPacked(segs, mode)
	}
	ds := make([]Desc, len(segs))
	for i, s := range segs {
		ds[i] = Desc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags |= DescWrite
		}
	}
	if q.useIndirect(mode, len(segs)) {
		for i := range ds[:len(ds)-1] {
			ds[i].Flags |= DescNext
			ds[i].Next = uint16(i + 1)
		}
		table, err := q.mem.AllocIn(q.bufRegion(), uint64(len(ds))*DescSize, DescSize)
		if err != nil {
			return nil, err
		}
		if err := q.WriteTable(table, ds); err != nil {
			q.mem.Free(table)
			return nil, err
		}
		q.mu.Lock()
		defer q.mu.Unlock()
		ids, err := q.allocDescs(1)
		if err != nil {
			q.mem.Free(table)
			return nil, err
		}
		q.WriteDesc(ids[0], Desc{Addr: table, Len: uint32(len(ds)) * DescSize, Flags: DescIndirect})
		return q.addLocked(uint32(ids[0]), ids, table), nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	ids, err := q.allocDescs(len(ds))
	if err != nil {
		return nil, err
	}
	for i := range ds {
		if i+1 < len(ds) {
			ds[i].Flags |= DescNext
			ds[i].Next = ids[i+1]
		}
		q.WriteDesc(ids[i], ds[i])
	}
	return q.addLocked(uint32(ids[0]), ids, 0), nil
}

// AddRaw makes head available as is (it may be any value, even >= Size)
// and tracks its completion. descs and table (an indirect table allocated
// from Memory, or 0) are released when the device returns the chain. It
// does not kick.
func (q *Queue) AddRaw(head uint16, descs []uint16, table uint64) *Chain {
	q.splitOnly("AddRaw")
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.addLocked(uint32(head), descs, table)
}

func (q *Queue) addLocked(head uint32, descs []uint16, table uint64) *Chain {
	c := &Chain{q: q, Head: head, descs: descs, table: table, done: make(chan struct{})}
	if old := q.inflight[head]; old != nil {
		q.violate("driver bug: head %d submitted twice", head)
	}
	q.inflight[head] = c
	q.WriteAvailSlot(q.availIdx, uint16(head))
	q.availIdx++
	q.numAdded++
	q.publish()
	return c
}

// Notify decides, as Linux's virtqueue_kick_prepare does, whether the
// device wants a kick for what was published since the last decision, and
// kicks if so (KickAlways: always; KickManual: never).
func (q *Queue) Notify() (bool, error) {
	if q.Packed() {
		return q.notifyPacked()
	}
	q.mu.Lock()
	newIdx := q.availIdx
	oldIdx := newIdx - q.numAdded
	q.numAdded = 0
	cfg := q.cfg
	q.mu.Unlock()
	var kick bool
	switch cfg.Kick {
	case KickAlways:
		kick = true
	case KickManual:
		return false, nil
	default:
		// The store that published avail.idx was a full barrier (XCHG on
		// amd64; seq-cst in Go's model), so this read is ordered after it.
		if cfg.EventIdx {
			kick = NeedEvent(q.AvailEvent(), newIdx, oldIdx)
		} else {
			kick = q.UsedFlags()&UsedNoNotify == 0
		}
	}
	if !kick {
		return false, nil
	}
	return true, q.Kick()
}

// NeedEvent is vring_need_event: whether moving an index from old to new
// crosses the event index (for packed rings see PackedNeedEvent).
func NeedEvent(event, newIdx, oldIdx uint16) bool {
	return newIdx-event-1 < newIdx-oldIdx
}

// Submit is Add followed by Notify.
func (q *Queue) Submit(segs []Segment, mode IndirectMode) (*Chain, error) {
	c, err := q.Add(segs, mode)
	if err != nil {
		return nil, err
	}
	_, err = q.Notify()
	return c, err
}

// Kick writes the kick eventfd unconditionally.
//
// The write happens under the queue lock: NewKickFd closes the old fd once
// it has swapped it out, and a write after that close could land in
// whatever file reused the fd number.
func (q *Queue) Kick() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.kickFd < 0 {
		return errors.New("vmm: queue has no kick fd")
	}
	q.kicks++
	_, err := unix.Write(q.kickFd, U64(1))
	return err
}

// Wait waits for the device to return the chain and returns the used
// length. On timeout the error tells whether used.idx had moved (packed: a
// used descriptor was waiting) without a notification.
func (c *Chain) Wait(timeout time.Duration) (uint32, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-c.done:
		return c.usedLen, c.err
	case <-t.C:
	}
	q := c.q
	q.mu.Lock()
	defer q.mu.Unlock()
	select {
	case <-c.done:
		return c.usedLen, c.err
	default:
	}
	if q.cfg.Packed {
		return 0, q.packedTimeout(c)
	}
	used := q.UsedIdx()
	if used != q.lastUsed {
		return 0, fmt.Errorf("%w: ring %d head %d: used.idx is %d but interrupts delivered only up to %d "+
			"(missing call notification; %d signals on stale call fds)", ErrTimeout, q.Index, c.Head, used, q.lastUsed, q.lost)
	}
	return 0, fmt.Errorf("%w: ring %d head %d not returned (avail.idx %d, used.idx %d)",
		ErrTimeout, q.Index, c.Head, q.availIdx, used)
}

// Done is closed when the chain completes (or is abandoned).
func (c *Chain) Done() <-chan struct{} { return c.done }

// UsedLen is the length the device reported; valid once Done is closed.
func (c *Chain) UsedLen() uint32 { return c.usedLen }

// complete runs under q.mu.
func (c *Chain) complete(n uint32, err error) {
	c.usedLen, c.err = n, err
	q := c.q
	q.freeDescs(c.descs)
	if c.table != 0 && err == nil {
		q.mem.Free(c.table)
	}
	close(c.done)
}

// ---- completions ----

// Harvest collects whatever the used ring holds right now, without waiting
// for a notification (e.g. after GET_VRING_BASE), and returns it.
func (q *Queue) Harvest() []Completion {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.harvestLocked()
}

func (q *Queue) harvestLocked() []Completion {
	if q.cfg.Packed {
		return q.harvestPackedLocked()
	}
	var got []Completion
	for {
		// The atomic load orders the element reads after it.
		idx := q.UsedIdx()
		if idx == q.lastUsed {
			break
		}
		if n := idx - q.lastUsed; n > q.cfg.Size {
			q.violate("used.idx moved from %d to %d, more than the ring size", q.lastUsed, idx)
		}
		for q.lastUsed != idx {
			e := q.used[4+8*int(q.lastUsed%q.cfg.Size):]
			c := Completion{le.Uint32(e), le.Uint32(e[4:])}
			q.lastUsed++
			got = append(got, c)
			ch := q.inflight[c.ID]
			if ch == nil {
				q.violate("used element %d returns id %d, which is not in flight", q.lastUsed-1, c.ID)
				continue
			}
			delete(q.inflight, c.ID)
			ch.complete(c.Len, nil)
		}
		if q.cfg.EventIdx {
			// Like virtqueue_enable_cb: ask for an interrupt at the next
			// completion, then (the CAS being a full barrier) re-check
			// used.idx for elements the device pushed before it saw that.
			q.SetUsedEvent(q.lastUsed)
		}
	}
	q.history = append(q.history, got...)
	return got
}

func (q *Queue) violate(format string, args ...any) {
	q.violations = append(q.violations, fmt.Sprintf("ring %d: ", q.Index)+fmt.Sprintf(format, args...))
}

// Violations lists device misbehaviour seen so far (ids returned twice or
// never made available, used.idx jumps; on packed rings also used lengths
// beyond a chain's writable bytes).
func (q *Queue) Violations() []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]string(nil), q.violations...)
}

// History returns every used element collected so far, in ring order.
func (q *Queue) History() []Completion {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]Completion(nil), q.history...)
}

// InFlight is the number of chains made available and not yet returned.
func (q *Queue) InFlight() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.cfg.Packed {
		n := 0
		for _, c := range q.inflight {
			for ; c != nil; c = c.sameID {
				n++
			}
		}
		return n
	}
	return len(q.inflight)
}

// Stats are notification counters.
type Stats struct {
	Kicks      int // kick eventfd writes
	Interrupts int // call eventfd signals honoured
	Lost       int // signals on call fds replaced more than a grace period ago
}

// Stats returns the notification counters.
func (q *Queue) Stats() Stats {
	q.mu.Lock()
	defer q.mu.Unlock()
	return Stats{q.kicks, q.irqs, q.lost}
}

// ---- eventfds and the interrupt handler ----

// NewKickFd replaces the kick eventfd with a fresh one, created signalled
// as QEMU's host notifiers are (unless QuietKick), and returns it for
// SET_VRING_KICK. The old one is closed.
func (q *Queue) NewKickFd() (int, error) {
	var init uint = 1
	if q.cfg.QuietKick {
		init = 0
	}
	fd, err := eventfd(init)
	if err != nil {
		return -1, err
	}
	q.mu.Lock()
	old := q.kickFd
	q.kickFd = fd
	q.mu.Unlock()
	if old >= 0 {
		unix.Close(old)
	}
	return fd, nil
}

// CallFd is the call eventfd the interrupt handler currently listens on.
func (q *Queue) CallFd() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.callFd
}

// ErrFd is the eventfd sent with SET_VRING_ERR.
func (q *Queue) ErrFd() int { return q.errFd }

// ErrSignalled reads (and clears) the error eventfd's counter.
func (q *Queue) ErrSignalled() uint64 { return readEventfd(q.errFd) }

// NewCallFd replaces the call eventfd with a fresh one and returns it for
// SET_VRING_CALL. Signals still pending on the old one are delivered (as
// QEMU does when it unmasks a vector), and the old one is still honoured
// for a short grace period; after that its signals count as lost.
func (q *Queue) NewCallFd() (int, error) {
	fd, err := eventfd(0)
	if err != nil {
		return -1, err
	}
	q.mu.Lock()
	q.stale = append(q.stale, staleFd{q.callFd, time.Now()})
	q.callFd = fd
	q.mu.Unlock()
	q.wake()
	return fd, nil
}

// Interrupt delivers a notification as if the call eventfd was signalled
// (a VMM injecting a pending interrupt).
func (q *Queue) Interrupt() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.irqs++
	q.harvestLocked()
}

func (q *Queue) wake() { unix.Write(q.wakeFd, U64(1)) }

func readEventfd(fd int) uint64 {
	var b [8]byte
	n, err := unix.Read(fd, b[:])
	if err != nil || n != 8 {
		return 0
	}
	return le.Uint64(b[:])
}

// irqLoop is the guest's interrupt handler for this queue.
func (q *Queue) irqLoop() {
	defer close(q.irqDone)
	for {
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			return
		}
		fds := []unix.PollFd{{Fd: int32(q.wakeFd), Events: unix.POLLIN}, {Fd: int32(q.callFd), Events: unix.POLLIN}}
		for _, s := range q.stale {
			fds = append(fds, unix.PollFd{Fd: int32(s.fd), Events: unix.POLLIN})
		}
		stale := append([]staleFd(nil), q.stale...)
		poll := q.cfg.Notify == NotifyPoll
		q.mu.Unlock()

		timeout := -1
		if poll {
			timeout = 1
		}
		if _, err := unix.Poll(fds, timeout); err != nil && err != unix.EINTR {
			return
		}
		irq := false
		if fds[0].Revents != 0 {
			readEventfd(q.wakeFd)
		}
		if fds[1].Revents != 0 && readEventfd(int(fds[1].Fd)) > 0 {
			irq = true
		}
		lost := 0
		for i, s := range stale {
			if fds[2+i].Revents != 0 && readEventfd(s.fd) > 0 {
				if time.Since(s.since) < staleGrace {
					irq = true
				} else {
					lost++
				}
			}
		}
		q.mu.Lock()
		q.lost += lost
		if irq {
			q.irqs++
		}
		if irq || poll {
			q.harvestLocked()
		}
		q.mu.Unlock()
	}
}

// Reset abandons every chain in flight (their Wait returns ErrAbandoned)
// and resets the driver state to a fresh ring, as a guest driver reset
// does. With newRing the ring moves to freshly allocated memory (the old
// ring is leaked on purpose: a buggy device may still write it); otherwise
// the old ring is zeroed in place.
func (q *Queue) Reset(newRing bool) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if newRing {
		old := q.addrs
		q.cfg.Addrs = RingAddrs{}
		if err := q.layout(RingAddrs{}); err != nil {
			q.addrs = old
			return err
		}
	} else {
		clear(q.desc)
		clear(q.avail)
		clear(q.used)
	}
	q.abandon(ErrAbandoned)
	q.resetFree()
	q.availIdx, q.numAdded, q.lastUsed = 0, 0, 0
	return nil
}

// Close stops the interrupt handler, abandons chains in flight and closes
// the queue's eventfds. The ring memory stays allocated.
func (q *Queue) Close() {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	q.closed = true
	q.mu.Unlock()
	q.wake()
	<-q.irqDone
	q.mu.Lock()
	defer q.mu.Unlock()
	q.abandon(ErrClosed)
	// Under the lock, so that a concurrent Kick never writes a closed
	// (and possibly reused) fd number.
	q.closeFds()
}

// abandon completes every chain in flight with err, keeping their
// descriptors off the free list (the device may still read them).
func (q *Queue) abandon(err error) {
	for id, c := range q.inflight {
		delete(q.inflight, id)
		for ; c != nil; c = c.sameID {
			c.descs = nil
			c.complete(0, err)
		}
	}
}

func (q *Queue) closeFds() {
	for _, fd := range []int{q.kickFd, q.callFd, q.errFd, q.wakeFd} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	for _, s := range q.stale {
		unix.Close(s.fd)
	}
	q.kickFd, q.callFd, q.errFd, q.wakeFd, q.stale = -1, -1, -1, -1, nil
}
