package vmm

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// The driver side of a packed virtqueue (VIRTIO_F_RING_PACKED, virtio 1.2
// §2.8), written from the specification and from what Linux's
// virtio_ring.c does, as the split side is.
//
// One ring of 16-byte descriptors {le64 addr, le32 len, le16 id, le16
// flags} carries both directions. The driver writes a chain at consecutive
// slots from its next avail slot; the device returns a buffer by
// overwriting ONE descriptor at its own next used slot with the buffer id
// and the used length, and advances by the number of slots the chain took.
// Which lap a descriptor belongs to is told by its AVAIL and USED bits
// against the wrap counters each side keeps (starting at 1, flipped when
// its index passes the end of the ring), so the size need not be a power
// of 2.
//
// On a packed Queue the fields that hold the split ring's parts hold the
// packed ones: desc is the descriptor ring, avail the driver event area
// (the driver writes it, the device reads it) and used the device event
// area (the device writes it, the driver reads it), each {le16 off_wrap,
// le16 flags}; RingAddrs' Desc, Avail and Used, and SET_VRING_ADDR's
// fields, name them in the same order.

// Packed descriptor flags, besides DescNext, DescWrite and DescIndirect.
// Linux's uapi header names 7 and 15 as shift counts; these are masks.
const (
	DescAvail = 1 << 7
	DescUsed  = 1 << 15
)

// Event suppression: the flags field of the driver and device event areas.
const (
	EventFlagEnable  = 0 // notify on every buffer
	EventFlagDisable = 1 // do not notify
	EventFlagDesc    = 2 // notify when off_wrap is crossed (only with EVENT_IDX)
)

// WrapBit is the wrap counter bit of an event area's off_wrap (and of each
// half of a packed ring's vring base).
const WrapBit = 1 << 15

// MaxPackedSize is the largest packed ring: indices are 15 bits.
const MaxPackedSize = 1 << 15

// PackedResetBase is the SET_VRING_BASE value of a packed ring the driver
// has just set up (indices 0, both wrap counters 1): what QEMU sends after
// a reset.
const PackedResetBase = 0x80008000

// PackedDesc is one packed-ring descriptor: {le64 addr, le32 len, le16 id,
// le16 flags}.
type PackedDesc struct {
	Addr  uint64
	Len   uint32
	ID    uint16
	Flags uint16
}

// PackedBase is the u32 that SET_VRING_BASE and GET_VRING_BASE carry for
// a packed ring: the device's next avail slot and avail wrap counter in
// the low half, its next used slot and used wrap counter in the high half.
type PackedBase struct {
	AvailIdx  uint16 // bits 0-14
	AvailWrap bool   // bit 15
	UsedIdx   uint16 // bits 16-30
	UsedWrap  bool   // bit 31
}

// ParsePackedBase decodes a packed ring's vring base.
func ParsePackedBase(v uint32) PackedBase {
	lo, hi := uint16(v), uint16(v>>16)
	return PackedBase{lo &^ WrapBit, lo&WrapBit != 0, hi &^ WrapBit, hi&WrapBit != 0}
}

// Uint32 encodes b as SET_VRING_BASE carries it.
func (b PackedBase) Uint32() uint32 {
	return uint32(OffWrap(b.AvailIdx, b.AvailWrap)) | uint32(OffWrap(b.UsedIdx, b.UsedWrap))<<16
}

func (b PackedBase) String() string {
	return fmt.Sprintf("avail %d wrap %d, used %d wrap %d", b.AvailIdx, b2i(b.AvailWrap), b.UsedIdx, b2i(b.UsedWrap))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// OffWrap encodes an index and a wrap counter as an event area's off_wrap.
func OffWrap(idx uint16, wrap bool) uint16 {
	if wrap {
		return idx | WrapBit
	}
	return idx &^ WrapBit
}

// PackedRingBytes returns the sizes of the descriptor ring and of the
// driver and device event areas of a packed ring of n entries.
func PackedRingBytes(n uint16) (desc, driver, device uint64) {
	return uint64(n) * DescSize, 4, 4
}

// PackedNeedEvent is the notification decision against an event area
// whose flags are EventFlagDesc: whether moving an index from oldIdx to
// newIdx (in 16-bit arithmetic, newIdx in the lap whose wrap counter is
// wrap) crosses the event offWrap names, as vring_need_event does once an
// event in the previous lap is moved back by the ring size. The driver
// uses it for kicks (its avail index, the device event area), the device
// for interrupts (its used index, the driver event area).
func PackedNeedEvent(offWrap uint16, size, newIdx, oldIdx uint16, wrap bool) bool {
	event := offWrap &^ WrapBit
	if (offWrap&WrapBit != 0) != wrap {
		event -= size
	}
	return NeedEvent(event, newIdx, oldIdx)
}

// availBits are the AVAIL and USED bits that make a descriptor available
// in the lap whose driver wrap counter is wrap.
func availBits(wrap bool) uint16 {
	if wrap {
		return DescAvail
	}
	return DescUsed
}

// usedBits are the AVAIL and USED bits of a used descriptor written in the
// lap whose device wrap counter is wrap.
func usedBits(wrap bool) uint16 {
	if wrap {
		return DescAvail | DescUsed
	}
	return 0
}

// IsUsed reports whether a descriptor with flags is used in the lap whose
// wrap counter is wrap: AVAIL == USED == wrap.
func IsUsed(flags uint16, wrap bool) bool {
	return flags&(DescAvail|DescUsed) == usedBits(wrap)
}

// IsAvail reports whether a descriptor with flags is available in the lap
// whose wrap counter is wrap: AVAIL == wrap, USED != wrap.
func IsAvail(flags uint16, wrap bool) bool {
	return flags&(DescAvail|DescUsed) == availBits(wrap)
}

// advance moves a packed ring position by k slots, flipping the wrap
// counter when it passes the end.
func advance(idx uint16, wrap bool, k int, size uint16) (uint16, bool) {
	i := int(idx) + k
	for i >= int(size) {
		i -= int(size)
		wrap = !wrap
	}
	return uint16(i), wrap
}

// packedState is the packed driver's bookkeeping, as Linux's
// vring_virtqueue_packed keeps it: slots are used in ring order and freed
// in the order the device returns them (which is why only their count is
// kept), buffer ids come from a free list and name the chain in flight.
type packedState struct {
	nextAvail uint16 // slot the next chain starts at
	availWrap bool   // the driver's avail wrap counter
	nextUsed  uint16 // slot the device's next used descriptor goes to
	usedWrap  bool   // the driver's used wrap counter
	freeSlots int

	// idRefs counts the chains in flight under each id < Size (more than
	// one only for BadDuplicateID); freeIDs is a stack of candidates,
	// possibly stale (an id that AddPackedRaw took without popping it),
	// which allocID skips.
	idRefs  []uint16
	freeIDs []uint16

	pinned bool   // SetDriverEvent gave the driver event area to the test
	desync string // why the used ring can no longer be followed; "" while in sync

	// Where the last used descriptor was collected and how many slots its
	// chain took, for the diagnosis of a device whose used index is out
	// of step (packedTimeout).
	lastUsed      uint16
	lastUsedWrap  bool
	lastUsedSlots int
}

// resetPacked is resetFree for a packed ring: every slot and id free, both
// wrap counters 1.
func (q *Queue) resetPacked() {
	n := int(q.cfg.Size)
	q.pk = packedState{availWrap: true, usedWrap: true, freeSlots: n,
		idRefs: make([]uint16, n), freeIDs: make([]uint16, 0, n)}
	for i := n - 1; i >= 0; i-- {
		q.pk.freeIDs = append(q.pk.freeIDs, uint16(i))
	}
}

// layoutPacked allocates a packed ring in one page-aligned block (the
// descriptor ring, then the driver and device event areas, which a ring
// of 16-byte entries leaves 4-aligned) or adopts the given addresses.
func (q *Queue) layoutPacked(a RingAddrs) error {
	dl, drv, dev := PackedRingBytes(q.cfg.Size)
	if a == (RingAddrs{}) {
		base, err := q.mem.AllocIn(q.cfg.RingRegion, dl+drv+dev, PageSize)
		if err != nil {
			return err
		}
		a = RingAddrs{base, base + dl, base + dl + drv}
	}
	if a.Desc%16 != 0 || a.Avail%4 != 0 || a.Used%4 != 0 {
		return fmt.Errorf("vmm: misaligned packed ring %+v", a)
	}
	var err error
	if q.desc, err = q.mem.Slice(a.Desc, dl); err != nil {
		return err
	}
	if q.avail, err = q.mem.Slice(a.Avail, drv); err != nil {
		return err
	}
	if q.used, err = q.mem.Slice(a.Used, dev); err != nil {
		return err
	}
	q.addrs = a
	return nil
}

// Packed reports whether the queue is a packed ring.
func (q *Queue) Packed() bool { return q.packed.Load() }

// splitOnly guards the split ring's raw accessors: on a packed ring their
// offsets name other fields, and a silently wrong answer would mislead a
// test more than a panic does.
func (q *Queue) splitOnly(name string) {
	if q.packed.Load() {
		panic(fmt.Sprintf("vmm: Queue.%s is for split rings; ring %d is packed", name, q.Index))
	}
}

func (q *Queue) packedOnly(name string) {
	if !q.packed.Load() {
		panic(fmt.Sprintf("vmm: Queue.%s is for packed rings; ring %d is split", name, q.Index))
	}
}

// setPacked switches an idle queue between the layouts, in fresh ring
// memory (or at the fixed addresses of its configuration): Device does so
// when the negotiated features differ from what Options asked for.
func (q *Queue) setPacked(p bool) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.cfg.Packed == p {
		return nil
	}
	if len(q.inflight) > 0 {
		return fmt.Errorf("vmm: ring %d has chains in flight; cannot change its layout", q.Index)
	}
	if p && int(q.cfg.Size) > MaxPackedSize {
		return fmt.Errorf("vmm: packed ring of %d entries (at most %d)", q.cfg.Size, MaxPackedSize)
	}
	old := q.cfg
	q.cfg.Packed = p
	if err := q.layout(q.cfg.Addrs); err != nil {
		q.cfg = old
		if lerr := q.layout(q.addrs); lerr != nil {
			return errors.Join(err, lerr)
		}
		return err
	}
	q.packed.Store(p)
	q.resetFree()
	q.availIdx, q.numAdded, q.lastUsed = 0, 0, 0
	return nil
}

// ---- raw packed ring access ----

// The ring accessors below take the ring's bytes rather than a Queue so
// that the in-test device (packed_test.go) can use them too.

// tail returns the aligned 32-bit word {le16 id, le16 flags} of slot i of
// a descriptor ring: the driver makes a descriptor available, and the
// device marks it used, by storing it last.
func tail(desc []byte, i uint16) *uint32 {
	w, _ := word(desc, int(i)*DescSize+12)
	return w
}

func loadTail(desc []byte, i uint16) (id, flags uint16) {
	v := atomic.LoadUint32(tail(desc, i))
	return uint16(v), uint16(v >> 16)
}

func storeTail(desc []byte, i, id, flags uint16) {
	atomic.StoreUint32(tail(desc, i), uint32(id)|uint32(flags)<<16)
}

// writePackedDesc writes addr and len, then {id, flags} in one atomic
// store, so that a descriptor made available this way is complete when the
// device sees it.
func writePackedDesc(desc []byte, i uint16, d PackedDesc) {
	b := desc[int(i)*DescSize:]
	le.PutUint64(b, d.Addr)
	le.PutUint32(b[8:], d.Len)
	storeTail(desc, i, d.ID, d.Flags)
}

// readPackedDesc reads the flags first, so that addr and len are at least
// as new as the flags say.
func readPackedDesc(desc []byte, i uint16) PackedDesc {
	id, flags := loadTail(desc, i)
	b := desc[int(i)*DescSize:]
	return PackedDesc{Addr: le.Uint64(b), Len: le.Uint32(b[8:]), ID: id, Flags: flags}
}

// loadEvent and storeEvent access an event area {le16 off_wrap, le16
// flags} as one word: a reader never sees a new flags value with a stale
// offset, and the store is the full barrier that a re-check after it needs.
func loadEvent(area []byte) (offWrap, flags uint16) {
	w, _ := word(area, 0)
	v := atomic.LoadUint32(w)
	return uint16(v), uint16(v >> 16)
}

func storeEvent(area []byte, offWrap, flags uint16) {
	w, _ := word(area, 0)
	atomic.StoreUint32(w, uint32(offWrap)|uint32(flags)<<16)
}

// WritePackedDesc writes slot i (i < Size) of a packed ring as is, {id,
// flags} last.
func (q *Queue) WritePackedDesc(i uint16, d PackedDesc) {
	q.packedOnly("WritePackedDesc")
	writePackedDesc(q.desc, i, d)
}

// ReadPackedDesc reads slot i of a packed ring, flags first.
func (q *Queue) ReadPackedDesc(i uint16) PackedDesc {
	q.packedOnly("ReadPackedDesc")
	return readPackedDesc(q.desc, i)
}

// EncodePackedDescs encodes descriptors as a packed indirect table.
func EncodePackedDescs(ds []PackedDesc) []byte {
	var b []byte
	for _, d := range ds {
		b = le.AppendUint64(b, d.Addr)
		b = le.AppendUint32(b, d.Len)
		b = le.AppendUint16(b, d.ID)
		b = le.AppendUint16(b, d.Flags)
	}
	return b
}

// WritePackedTable writes a packed indirect table at gpa (which may
// straddle GPA-contiguous regions).
func (q *Queue) WritePackedTable(gpa uint64, ds []PackedDesc) error {
	return q.mem.WriteAt(EncodePackedDescs(ds), gpa)
}

// DriverEvent reads the driver event area: off_wrap and flags.
func (q *Queue) DriverEvent() (offWrap, flags uint16) {
	q.packedOnly("DriverEvent")
	return loadEvent(q.avail)
}

// SetDriverEvent writes the driver event area, and hands it to the test:
// the driver stops updating it (after a harvest with EVENT_IDX it would
// otherwise ask for the next interrupt) until Reset.
func (q *Queue) SetDriverEvent(offWrap, flags uint16) {
	q.packedOnly("SetDriverEvent")
	q.mu.Lock()
	defer q.mu.Unlock()
	q.pk.pinned = true
	storeEvent(q.avail, offWrap, flags)
}

// DeviceEvent reads the device event area: off_wrap and flags.
func (q *Queue) DeviceEvent() (offWrap, flags uint16) {
	q.packedOnly("DeviceEvent")
	return loadEvent(q.used)
}

// NextAvail is the slot the driver's next chain starts at and its avail
// wrap counter.
func (q *Queue) NextAvail() (idx uint16, wrap bool) {
	q.packedOnly("NextAvail")
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.pk.nextAvail, q.pk.availWrap
}

// NextUsed is the slot at which the driver expects the device's next used
// descriptor, and its used wrap counter.
func (q *Queue) NextUsed() (idx uint16, wrap bool) {
	q.packedOnly("NextUsed")
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.pk.nextUsed, q.pk.usedWrap
}

// IdleBase is the GET_VRING_BASE answer a device owes for this ring once
// every chain made available has been returned and collected: avail.idx
// on a split ring; on a packed ring both of the driver's positions and
// wrap counters, which then equal the device's.
func (q *Queue) IdleBase() uint32 {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.cfg.Packed {
		return uint32(q.availIdx)
	}
	return PackedBase{q.pk.nextAvail, q.pk.availWrap, q.pk.nextUsed, q.pk.usedWrap}.Uint32()
}

// AddPackedRaw makes ds available as one chain at the driver's next avail
// slots, in order, the head's flags written last. Each descriptor keeps
// its address, length, id and flags (NEXT, WRITE, INDIRECT or anything
// else) except AVAIL and USED, which are set for the lap of its slot. The
// chain is tracked under the id of its last descriptor (where the spec
// puts the buffer id) and takes len(ds) slots; table (an indirect table
// from Memory, or 0) is freed when it completes. It does not kick.
func (q *Queue) AddPackedRaw(ds []PackedDesc, table uint64) (*Chain, error) {
	q.packedOnly("AddPackedRaw")
	if len(ds) == 0 {
		return nil, errors.New("vmm: empty chain")
	}
	wlen := q.writableBytes(ds)
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(ds) > q.pk.freeSlots {
		return nil, ErrRingFull
	}
	c := q.newPackedChain(ds[len(ds)-1].ID, len(ds), table, wlen)
	q.publishPacked(ds, 0)
	q.trackPacked(c, false)
	return c, nil
}

// writableBytes is what the device may write into a chain of ds: the
// lengths of its writable descriptors, those of an indirect table
// included when the table can be read (a malformed one counts 0).
func (q *Queue) writableBytes(ds []PackedDesc) uint32 {
	var n uint32
	for _, d := range ds {
		switch {
		case d.Flags&DescIndirect != 0:
			if d.Len == 0 || d.Len%DescSize != 0 || d.Len > MaxPackedSize*DescSize {
				continue
			}
			b := make([]byte, d.Len)
			if q.mem.ReadAt(b, d.Addr) != nil {
				continue
			}
			for e := b; len(e) > 0; e = e[DescSize:] {
				if le.Uint16(e[14:])&DescWrite != 0 {
					n += le.Uint32(e[8:])
				}
			}
		case d.Flags&DescWrite != 0:
			n += d.Len
		}
	}
	return n
}

func (q *Queue) newPackedChain(id uint16, slots int, table uint64, wlen uint32) *Chain {
	return &Chain{q: q, Head: uint32(id), table: table, slots: slots, wlen: wlen, done: make(chan struct{})}
}

// allocID takes a buffer id off the free list, as Linux's free_head does.
func (q *Queue) allocID() (uint16, error) {
	for len(q.pk.freeIDs) > 0 {
		id := q.pk.freeIDs[len(q.pk.freeIDs)-1]
		q.pk.freeIDs = q.pk.freeIDs[:len(q.pk.freeIDs)-1]
		if q.pk.idRefs[id] == 0 {
			return id, nil
		}
	}
	return 0, ErrRingFull
}

// publishPacked writes ds at the driver's next avail slots and makes them
// available, then hold more slots that it writes but leaves unavailable
// (BadChainUnterminated). Every descriptor but the head is written first
// and the head's {id, flags} last: a device that sees the head available
// then sees the whole chain (the atomic store is a release). Called with
// q.mu held and enough free slots.
func (q *Queue) publishPacked(ds []PackedDesc, hold int) {
	size := q.cfg.Size
	head, wrap := q.pk.nextAvail, q.pk.availWrap
	headFlags := ds[0].Flags&^(DescAvail|DescUsed) | availBits(wrap)
	b := q.desc[int(head)*DescSize:]
	le.PutUint64(b, ds[0].Addr)
	le.PutUint32(b[8:], ds[0].Len)
	slot := head
	for i := 1; i < len(ds)+hold; i++ {
		// A chain continues from the last slot to slot 0, where the
		// driver's wrap counter flips: the descriptors after that carry
		// the next lap's bits.
		slot, wrap = advance(slot, wrap, 1, size)
		if i < len(ds) {
			d := ds[i]
			d.Flags = d.Flags&^(DescAvail|DescUsed) | availBits(wrap)
			writePackedDesc(q.desc, slot, d)
			continue
		}
		// What the device left there in the previous lap: a used
		// descriptor of that lap, not available in this one.
		last := ds[len(ds)-1]
		writePackedDesc(q.desc, slot, PackedDesc{Addr: last.Addr, Len: last.Len, ID: last.ID, Flags: usedBits(!wrap)})
	}
	q.pk.nextAvail, q.pk.availWrap = advance(q.pk.nextAvail, q.pk.availWrap, len(ds)+hold, size)
	q.pk.freeSlots -= len(ds) + hold
	q.numAdded += uint16(len(ds) + hold)
	storeTail(q.desc, head, ds[0].ID, headFlags)
}

// trackPacked records c as in flight. Chains sharing an id are kept in
// submission order behind the first; dupOK says the duplicate is meant
// (BadDuplicateID), otherwise it is a driver bug, recorded as the split
// ring's addLocked records a head submitted twice.
func (q *Queue) trackPacked(c *Chain, dupOK bool) {
	if first := q.inflight[c.Head]; first != nil {
		if !dupOK {
			q.violate("driver bug: id %d submitted twice", c.Head)
		}
		for first.sameID != nil {
			first = first.sameID
		}
		first.sameID = c
	} else {
		q.inflight[c.Head] = c
	}
	if int(c.Head) < len(q.pk.idRefs) {
		q.pk.idRefs[c.Head]++
	}
}

// untrackPacked takes the chain a used descriptor with id and length n
// returns off the in-flight list, or returns nil if no chain has that id.
// With several chains under one id (BadDuplicateID) a zero length goes to
// the newest, the duplicate a device rejects, and anything else to the
// oldest: they take the same number of slots, so the ring stays in step
// whichever it is.
func (q *Queue) untrackPacked(id uint16, n uint32) *Chain {
	first := q.inflight[uint32(id)]
	if first == nil {
		return nil
	}
	c, prev := first, (*Chain)(nil)
	if n == 0 {
		for c.sameID != nil {
			prev, c = c, c.sameID
		}
	}
	switch {
	case prev != nil:
		prev.sameID = c.sameID
	case c.sameID != nil:
		q.inflight[uint32(id)] = c.sameID
	default:
		delete(q.inflight, uint32(id))
	}
	c.sameID = nil
	if int(id) < len(q.pk.idRefs) {
		if q.pk.idRefs[id]--; q.pk.idRefs[id] == 0 {
			q.pk.freeIDs = append(q.pk.freeIDs, id)
		}
	}
	return c
}

// addPacked is Add on a packed ring.
func (q *Queue) addPacked(segs []Segment, mode IndirectMode) (*Chain, error) {
	pc, err := q.layoutChain(segs, mode)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	id, err := q.allocSlots(len(pc.ds))
	if err != nil {
		pc.free(q.mem)
		return nil, err
	}
	return q.addChainLocked(pc, id, false), nil
}

// packedChain is a chain laid out, not yet in the ring.
type packedChain struct {
	ds    []PackedDesc // what goes into the ring, ids not set
	table uint64       // our indirect table, 0 if none
	wlen  uint32       // writable bytes
}

func (pc packedChain) free(m *Memory) {
	if pc.table != 0 {
		m.Free(pc.table)
	}
}

// layoutChain lays segs out as virtqueue_add_packed does: one indirect
// descriptor whose table entries carry neither NEXT (they are
// consecutive) nor an id, or one descriptor per segment with NEXT on all
// but the last.
func (q *Queue) layoutChain(segs []Segment, mode IndirectMode) (packedChain, error) {
	var pc packedChain
	ds := make([]PackedDesc, len(segs))
	for i, s := range segs {
		ds[i] = PackedDesc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags = DescWrite
			pc.wlen += s.Len
		}
	}
	if q.useIndirect(mode, len(segs)) {
		table, err := q.mem.AllocIn(q.bufRegion(), uint64(len(ds))*DescSize, DescSize)
		if err != nil {
			return pc, err
		}
		if err := q.WritePackedTable(table, ds); err != nil {
			q.mem.Free(table)
			return pc, err
		}
		pc.table = table
		pc.ds = []PackedDesc{{Addr: table, Len: uint32(len(ds)) * DescSize, Flags: DescIndirect}}
		return pc, nil
	}
	for i := range ds[:len(ds)-1] {
		ds[i].Flags |= DescNext
	}
	pc.ds = ds
	return pc, nil
}

// addChainLocked makes pc available under id, which Linux writes into
// every descriptor of the chain (the spec requires it only in the last).
func (q *Queue) addChainLocked(pc packedChain, id uint16, dupOK bool) *Chain {
	for i := range pc.ds {
		pc.ds[i].ID = id
	}
	c := q.newPackedChain(id, len(pc.ds), pc.table, pc.wlen)
	q.publishPacked(pc.ds, 0)
	q.trackPacked(c, dupOK)
	return c
}

// allocSlots checks that n slots are free and takes an id for them.
func (q *Queue) allocSlots(n int) (uint16, error) {
	if n > q.pk.freeSlots {
		return 0, ErrRingFull
	}
	return q.allocID()
}

// notifyPacked is Notify on a packed ring: virtqueue_kick_prepare_packed.
func (q *Queue) notifyPacked() (bool, error) {
	q.mu.Lock()
	newIdx, wrap := q.pk.nextAvail, q.pk.availWrap
	oldIdx := newIdx - q.numAdded // may wrap below 0: NeedEvent works mod 2^16
	q.numAdded = 0
	mode, size := q.cfg.Kick, q.cfg.Size
	q.mu.Unlock()
	var kick bool
	switch mode {
	case KickAlways:
		kick = true
	case KickManual:
		return false, nil
	default:
		// The atomic store of the head's flags was a full barrier, so
		// this read is ordered after the chain became available.
		off, flags := q.DeviceEvent()
		if flags == EventFlagDesc {
			kick = PackedNeedEvent(off, size, newIdx, oldIdx, wrap)
		} else {
			kick = flags != EventFlagDisable
		}
	}
	if !kick {
		return false, nil
	}
	return true, q.Kick()
}

// harvestPackedLocked is harvestLocked on a packed ring: collect used
// descriptors at the driver's next used slot for as long as they carry
// its used wrap counter, as virtqueue_get_buf_ctx_packed does, then with
// EVENT_IDX ask for an interrupt at the next one and look again.
func (q *Queue) harvestPackedLocked() []Completion {
	var got []Completion
	pk := &q.pk
	for {
		n := 0
		for pk.desync == "" {
			// The atomic load orders the len read after it.
			id, flags := loadTail(q.desc, pk.nextUsed)
			if !IsUsed(flags, pk.usedWrap) {
				break
			}
			ln := le.Uint32(q.desc[int(pk.nextUsed)*DescSize+8:])
			got = append(got, Completion{uint32(id), ln})
			n++
			c := q.untrackPacked(id, ln)
			if c == nil {
				// Without the chain there is no knowing how many
				// slots to skip: stop following the ring, as Linux
				// marks it broken.
				pk.desync = fmt.Sprintf("the used descriptor at slot %d (wrap %d) returns id %d, which is not in flight",
					pk.nextUsed, b2i(pk.usedWrap), id)
				q.violate("%s", pk.desync)
				break
			}
			if ln > c.wlen {
				q.violate("the used descriptor at slot %d returns id %d with len %d, more than its %d writable bytes",
					pk.nextUsed, id, ln, c.wlen)
			}
			pk.lastUsed, pk.lastUsedWrap, pk.lastUsedSlots = pk.nextUsed, pk.usedWrap, c.slots
			pk.nextUsed, pk.usedWrap = advance(pk.nextUsed, pk.usedWrap, c.slots, q.cfg.Size)
			pk.freeSlots += c.slots
			c.complete(ln, nil)
		}
		if n == 0 || !q.cfg.EventIdx || pk.pinned || pk.desync != "" {
			break
		}
		// Like virtqueue_enable_cb_prepare_packed: an interrupt when the
		// next used descriptor is written; the store is a full barrier,
		// so the next look sees what the device wrote before it read the
		// event.
		storeEvent(q.avail, OffWrap(pk.nextUsed, pk.usedWrap), EventFlagDesc)
	}
	q.history = append(q.history, got...)
	return got
}

// packedTimeout explains, with q.mu held, why chain c has not come back.
func (q *Queue) packedTimeout(c *Chain) error {
	pk := &q.pk
	if pk.desync != "" {
		return fmt.Errorf("%w: ring %d id %d not returned: the used ring could not be followed since %s",
			ErrTimeout, q.Index, c.Head, pk.desync)
	}
	if _, flags := loadTail(q.desc, pk.nextUsed); IsUsed(flags, pk.usedWrap) {
		return fmt.Errorf("%w: ring %d id %d: the descriptor at used slot %d (wrap %d) is used but interrupts "+
			"delivered only up to there (missing call notification; %d signals on stale call fds)",
			ErrTimeout, q.Index, c.Head, pk.nextUsed, b2i(pk.usedWrap), q.lost)
	}
	// A device that moved its used index by another count than the
	// chain's slots took writes its next used descriptor where the driver
	// never looks: among the slots of the chain collected last, or beyond
	// the next used slot among those in flight.
	from, fromWrap := pk.nextUsed, pk.usedWrap
	span := int(q.cfg.Size) - pk.freeSlots
	if pk.lastUsedSlots > 0 {
		from, fromWrap = pk.lastUsed, pk.lastUsedWrap
		span += pk.lastUsedSlots
	}
	for i := 1; i < span; i++ {
		slot, wrap := advance(from, fromWrap, i, q.cfg.Size)
		if slot == pk.nextUsed {
			continue
		}
		if id, flags := loadTail(q.desc, slot); IsUsed(flags, wrap) {
			return fmt.Errorf("%w: ring %d id %d not returned: a used descriptor (id %d) is at slot %d, where the "+
				"driver expects none (its next used slot is %d wrap %d; the last chain it collected took %d slots "+
				"from slot %d): the device's used index is out of step",
				ErrTimeout, q.Index, c.Head, id, slot, pk.nextUsed, b2i(pk.usedWrap), pk.lastUsedSlots, pk.lastUsed)
		}
	}
	return fmt.Errorf("%w: ring %d id %d not returned (next avail %d wrap %d, next used %d wrap %d)",
		ErrTimeout, q.Index, c.Head, pk.nextAvail, b2i(pk.availWrap), pk.nextUsed, b2i(pk.usedWrap))
}
