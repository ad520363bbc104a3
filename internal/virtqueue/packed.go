package virtqueue

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
)

// The packed ring (virtio 1.2 §2.8): one ring of 16-byte descriptors
// {addr, len, id, flags} that the driver fills and the device overwrites
// with used descriptors, both walking forwards, plus two 4-byte event
// suppression areas {off_wrap, flags}: the driver's, read by the device,
// and the device's, read by the driver.
//
// A slot is available when its AVAIL bit equals the driver's wrap counter
// and its USED bit does not; used when both equal the device's. Each side
// flips its counter when its index passes the last slot, so a chain may run
// from the last slot into slot 0. The device returns a chain with one used
// descriptor at its own used index and advances that index by the slots
// the chain took (an indirect chain takes one). Completions in another
// order than the chains' overwrite slots of chains still in flight: a
// chain is translated completely when it is popped.
//
// The driver names each buffer with an id the spec does not bound: the
// device keeps no state indexed by it, only the short list of ids in
// flight, to refuse a chain that reuses one.

// Packed descriptor flags beyond NEXT, WRITE and INDIRECT.
const (
	packedAvail = 1 << 7
	packedUsed  = 1 << 15
)

// Event suppression flags (both areas).
const (
	eventEnable  = 0
	eventDisable = 1
	eventDesc    = 2 // with EVENT_IDX: at off_wrap
)

// untracked marks a Token whose id is not in Queue.outstanding (a reused
// id, or the list was full): its push removes nothing.
const untracked Token = 1 << 32

func (q *Queue) packedInit(cfg Config, mem *GuestMemory) error {
	n := uint64(cfg.Size)
	if n == 0 || n > MaxSize {
		return fmt.Errorf("packed ring size %d not in 1..%d", n, MaxSize)
	}
	if cfg.DescAddr%16 != 0 || cfg.AvailAddr%4 != 0 || cfg.UsedAddr%4 != 0 {
		return fmt.Errorf("packed ring addresses desc %#x driver %#x device %#x misaligned", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr)
	}
	var ok1, ok2, ok3 bool
	q.desc, q.descGPA, ok1 = mem.userRange(cfg.DescAddr, descSize*n)
	q.avail, ok2 = mem.UserSlice(cfg.AvailAddr, 4)
	q.used, ok3 = mem.UserSlice(cfg.UsedAddr, 4)
	if !ok1 || !ok2 || !ok3 {
		return fmt.Errorf("packed ring desc %#x driver %#x device %#x (size %d) not inside one mapped region each", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr, n)
	}
	q.lastAvail, q.availWrap = uint16(cfg.Base&0x7fff), cfg.Base&(1<<15) != 0
	q.usedIdx, q.usedWrap = uint16(cfg.Base>>16&0x7fff), cfg.Base&(1<<31) != 0
	if q.lastAvail >= q.size || q.usedIdx >= q.size {
		return fmt.Errorf("packed ring base %#x: an index beyond the ring of %d", cfg.Base, n)
	}
	q.signalled, q.sigWrap = q.usedIdx, q.usedWrap
	q.outstanding = make([]uint16, 0, n)
	return nil
}

// descFlags reads slot i's flags with acquire semantics: the rest of the
// descriptor is read after it. The {id, flags} pair is one aligned word.
func (q *Queue) descFlags(i uint16) uint16 {
	return uint16(atomic.LoadUint32(word32(q.desc[int(i)*descSize+12:])) >> 16)
}

// availableIn reports whether flags mark a slot available to a device
// whose view of the driver's wrap counter is wrap.
func availableIn(flags uint16, wrap bool) bool {
	return (flags&packedAvail != 0) == wrap && (flags&packedUsed != 0) != wrap
}

func (q *Queue) packedAvailable() bool { return availableIn(q.descFlags(q.lastAvail), q.availWrap) }

// packedWaiting counts the chains available from lastAvail on, up to
// limit, walking at most one lap of slots.
func (q *Queue) packedWaiting(limit int) int {
	n := 0
	i, w := q.lastAvail, q.availWrap
	for slots := 0; n < limit && slots < int(q.size); slots++ {
		f := q.descFlags(i)
		if !availableIn(f, w) {
			break
		}
		if f&descNext == 0 {
			n++
		}
		if i++; i == q.size {
			i, w = 0, !w
		}
	}
	return n
}

// setDeviceEvent tells the driver when to kick: at the next slot we will
// look at (EVENT_IDX), or always. Kicks are never disabled, as on the split
// ring: a sleeping server relies on them.
func (q *Queue) setDeviceEvent() {
	v := uint32(eventEnable) << 16
	if q.eventIdx {
		v = packedBase(q.lastAvail, q.availWrap) | eventDesc<<16
	}
	// A plain aligned store (one MOV, not torn): after a pop nothing must
	// be ordered behind it, and EnableNotify issues its own full barrier.
	binary.LittleEndian.PutUint32(q.used, v)
	q.logUsed(0, 4)
}

func (q *Queue) packedEnableNotify() bool {
	q.setDeviceEvent()
	q.fullBarrier()
	return q.packedAvailable()
}

// packedPop takes the chain at lastAvail, which the last Snapshot found
// available. The chain's extent is found first, slot by slot: a chain
// longer than the ring, or one that runs into a slot the driver has not
// made available, leaves no way to know where the next chain starts, and
// breaks the ring. Any other fault is the chain's: ErrBadChain with its
// extent known, so it is returned with its id and slot count.
func (q *Queue) packedPop(c *DescChain) (bool, error) {
	q.seen = false
	start := q.lastAvail
	i, w := q.lastAvail, q.availWrap
	var bad error
	var id uint16
	slots := 0
	for {
		if slots == int(q.size) {
			c.Release()
			q.broken = true
			return false, fmt.Errorf("%w: the chain at slot %d is longer than the ring of %d", ErrBroken, start, q.size)
		}
		f := q.descFlags(i)
		if !availableIn(f, w) {
			c.Release()
			q.broken = true
			return false, fmt.Errorf("%w: the chain at slot %d runs into slot %d, which is not available", ErrBroken, start, i)
		}
		b := q.desc[int(i)*descSize:]
		addr, n := binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint32(b[8:])
		id = binary.LittleEndian.Uint16(b[12:])
		slots++
		if i++; i == q.size {
			i, w = 0, !w
		}
		if bad == nil {
			bad = q.packedBuffer(c, addr, n, f, slots == 1)
		}
		if f&descNext == 0 {
			break
		}
	}
	q.lastAvail, q.availWrap = i, w
	if q.eventIdx {
		q.setDeviceEvent() // the guest need not kick for what we are about to see
	}
	// The spec puts the buffer id in the chain's last descriptor.
	tok := Token(id) | Token(slots)<<16
	q.mu.Lock()
	switch {
	case slices.Contains(q.outstanding, id):
		tok |= untracked
		if bad == nil {
			bad = fmt.Errorf("buffer id %d is already in flight", id)
		}
	case len(q.outstanding) < cap(q.outstanding):
		q.outstanding = append(q.outstanding, id)
	default:
		tok |= untracked // more in flight than slots: a driver reusing slots early
	}
	q.mu.Unlock()
	c.Token = tok
	if bad != nil {
		return true, fmt.Errorf("%w: buffer id %d at slot %d: %v", ErrBadChain, id, start, bad)
	}
	return true, nil
}

// packedBuffer adds the buffer of one descriptor (flags f) to c: a direct
// buffer, or, for the chain's only descriptor, an indirect table.
func (q *Queue) packedBuffer(c *DescChain, addr uint64, n uint32, f uint16, first bool) error {
	if f&descIndirect == 0 {
		return c.addBuffer(addr, n, f&descWrite != 0)
	}
	switch {
	case f&descNext != 0:
		return errors.New("indirect descriptor with NEXT set")
	case !first:
		return errors.New("indirect descriptor after direct ones")
	}
	if err := q.indirectCheck(n); err != nil {
		return err
	}
	t, err := c.indirectTable(addr, n)
	if err != nil {
		return err
	}
	for k := 0; k < len(t); k += descSize {
		e := t[k : k+descSize]
		// NEXT and INDIRECT are reserved inside a table: ignored.
		w := binary.LittleEndian.Uint16(e[14:])&descWrite != 0
		if err := c.addBuffer(binary.LittleEndian.Uint64(e), binary.LittleEndian.Uint32(e[8:]), w); err != nil {
			return err
		}
	}
	return nil
}

// packedPush writes the used descriptor for tok at the used index and
// advances it by the chain's slots.
func (q *Queue) packedPush(tok Token, n uint32) {
	id, slots := uint16(tok), int(uint16(tok>>16))
	if tok&untracked == 0 {
		if k := slices.Index(q.outstanding, id); k >= 0 {
			last := len(q.outstanding) - 1
			q.outstanding[k] = q.outstanding[last]
			q.outstanding = q.outstanding[:last]
		}
	}
	off := int(q.usedIdx) * descSize
	d := q.desc[off : off+descSize]
	binary.LittleEndian.PutUint32(d[8:], n)
	var flags uint16
	if q.usedWrap {
		flags = packedAvail | packedUsed
	}
	if n > 0 {
		flags |= descWrite
	}
	// id and flags in one release store after len: the driver reads the
	// flags, then id and len.
	atomic.StoreUint32(word32(d[12:]), uint32(id)|uint32(flags)<<16)
	if q.log.Active() && q.usedLogOn.Load() {
		q.log.Mark(q.descGPA+uint64(off)+8, 8)
	}
	slots = max(slots, 1)
	q.pushed += slots
	next := int(q.usedIdx) + slots
	if next >= int(q.size) {
		next -= int(q.size)
		q.usedWrap = !q.usedWrap
	}
	q.usedIdx = uint16(next)
}

// packedNeedNotify decides whether the used descriptors written since the
// last decision call for an interrupt, from the driver event area.
func (q *Queue) packedNeedNotify() bool {
	if q.pushed == 0 {
		return false
	}
	q.fullBarrier()
	ev := atomic.LoadUint32(word32(q.avail))
	offWrap, flags := uint16(ev), uint16(ev>>16)
	var need bool
	switch {
	case flags == eventDisable:
	case flags == eventDesc && q.eventIdx:
		need = !q.decided || q.packedNeedEvent(offWrap)
	default: // enabled (or DESC without EVENT_IDX, reserved): always
		need = true
	}
	q.signalled, q.sigWrap, q.pushed, q.decided = q.usedIdx, q.usedWrap, 0, true
	return need
}

// packedNeedEvent reports whether the driver's event position lies among
// the slots used since the last decision: [signalled, usedIdx) on a line
// where positions of the previous lap count size less.
func (q *Queue) packedNeedEvent(offWrap uint16) bool {
	size := int(q.size)
	if q.pushed >= size {
		return true // a lap or more since the last decision: cannot tell
	}
	cur, old := int(q.usedIdx), int(q.signalled)
	if q.sigWrap != q.usedWrap {
		old -= size
	}
	ev := int(offWrap & 0x7fff)
	if (offWrap&0x8000 != 0) != q.usedWrap {
		ev -= size
	}
	return old <= ev && ev < cur
}
