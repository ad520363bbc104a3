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

// untracked marks a Token whose id is not in packedRing.outstanding (a
// reused id, or the list was full): its push removes nothing.
const untracked Token = 1 << 32

// packedRing is the state only a packed ring has. The consumer fields
// belong to the goroutine that pops; the producer fields are guarded by
// Queue.mu. Indices are slots, each with the wrap counter of its side.
type packedRing struct {
	ring        []byte // the descriptor ring
	ringGPA     uint64 // its guest address, where used descriptors are logged
	driverEvent []byte // the driver's event suppression area, read
	deviceEvent []byte // the device's event suppression area, written

	// Consumer state.
	availIdx  uint16 // next slot to pop
	availWrap bool   // the driver's wrap counter at availIdx
	seenChain bool   // the last snapshot found availIdx available

	// Producer state.
	usedIdx   uint16 // next slot to write a used descriptor at
	usedWrap  bool   // the device's wrap counter at usedIdx
	signalled uint16 // usedIdx at the last notification decision
	sigWrap   bool   // usedWrap at that decision
	pushed    int    // slots used since that decision
	// outstanding are the buffer ids popped and not yet pushed, to refuse
	// a chain reusing one (at most the chains in flight: a linear scan;
	// allocated once).
	outstanding []uint16
}

func newPackedRing(cfg Config, mem *GuestMemory) (*packedRing, error) {
	n := uint64(cfg.Size)
	if n == 0 || n > MaxSize {
		return nil, fmt.Errorf("packed ring size %d not in 1..%d", n, MaxSize)
	}
	if cfg.DescAddr%16 != 0 || cfg.AvailAddr%4 != 0 || cfg.UsedAddr%4 != 0 {
		return nil, fmt.Errorf("packed ring addresses desc %#x driver %#x device %#x misaligned", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr)
	}
	p := &packedRing{}
	var ok1, ok2, ok3 bool
	p.ring, p.ringGPA, ok1 = mem.userRange(cfg.DescAddr, descSize*n)
	p.driverEvent, ok2 = mem.UserSlice(cfg.AvailAddr, 4)
	p.deviceEvent, ok3 = mem.UserSlice(cfg.UsedAddr, 4)
	if !ok1 || !ok2 || !ok3 {
		return nil, fmt.Errorf("packed ring desc %#x driver %#x device %#x (size %d) not inside one mapped region each", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr, n)
	}
	p.availIdx, p.availWrap = uint16(cfg.Base&0x7fff), cfg.Base&(1<<15) != 0
	p.usedIdx, p.usedWrap = uint16(cfg.Base>>16&0x7fff), cfg.Base&(1<<31) != 0
	if p.availIdx >= cfg.Size || p.usedIdx >= cfg.Size {
		return nil, fmt.Errorf("packed ring base %#x: an index beyond the ring of %d", cfg.Base, n)
	}
	p.signalled, p.sigWrap = p.usedIdx, p.usedWrap
	p.outstanding = make([]uint16, 0, n)
	return p, nil
}

// base is SET_VRING_BASE's encoding of both indices and wrap counters.
func (p *packedRing) base() uint32 {
	return packedBase(p.availIdx, p.availWrap) | packedBase(p.usedIdx, p.usedWrap)<<16
}

func packedBase(idx uint16, wrap bool) uint32 {
	if wrap {
		return uint32(idx) | 1<<15
	}
	return uint32(idx)
}

// descFlags reads slot i's flags with acquire semantics: the rest of the
// descriptor is read after it. The {id, flags} pair is one aligned word.
func (p *packedRing) descFlags(i uint16) uint16 {
	return uint16(atomic.LoadUint32(word32(p.ring[int(i)*descSize+12:])) >> 16)
}

// availableIn reports whether flags mark a slot available to a device
// whose view of the driver's wrap counter is wrap.
func availableIn(flags uint16, wrap bool) bool {
	return (flags&packedAvail != 0) == wrap && (flags&packedUsed != 0) != wrap
}

// pending reports whether the slot at availIdx is available.
func (p *packedRing) pending() bool { return availableIn(p.descFlags(p.availIdx), p.availWrap) }

// waiting counts the chains available from availIdx on, up to limit,
// walking at most one lap of slots.
func (p *packedRing) waiting(q *Queue, limit int) int {
	n := 0
	i, w := p.availIdx, p.availWrap
	for slots := 0; n < limit && slots < int(q.size); slots++ {
		f := p.descFlags(i)
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
func (p *packedRing) setDeviceEvent(q *Queue) {
	v := uint32(eventEnable) << 16
	if q.eventIdx {
		v = packedBase(p.availIdx, p.availWrap) | eventDesc<<16
	}
	// A plain aligned store (one MOV, not torn): after a pop nothing must
	// be ordered behind it, and EnableNotify issues its own full barrier.
	binary.LittleEndian.PutUint32(p.deviceEvent, v)
	q.logUsed(0, 4)
}

func (p *packedRing) enableNotify(q *Queue) bool {
	p.setDeviceEvent(q)
	q.fullBarrier()
	return p.pending()
}

// snapshot looks at the slot at availIdx: pop takes its chain if it was
// available.
func (p *packedRing) snapshot(*Queue) (bool, error) {
	p.seenChain = p.pending()
	return p.seenChain, nil
}

func (p *packedRing) seen() bool { return p.seenChain }

// pop takes the chain at availIdx, which the last snapshot found
// available. The chain's extent is found first, slot by slot: a chain
// longer than the ring, or one that runs into a slot the driver has not
// made available, leaves no way to know where the next chain starts, and
// breaks the ring. Any other fault is the chain's: ErrBadChain with its
// extent known, so it is returned with its id and slot count.
func (p *packedRing) pop(q *Queue, c *DescChain) (bool, error) {
	p.seenChain = false
	start := p.availIdx
	i, w := p.availIdx, p.availWrap
	var bad error
	var id uint16
	slots := 0
	for {
		if slots == int(q.size) {
			c.Release()
			q.broken = true
			return false, fmt.Errorf("%w: the chain at slot %d is longer than the ring of %d", ErrBroken, start, q.size)
		}
		f := p.descFlags(i)
		if !availableIn(f, w) {
			c.Release()
			q.broken = true
			return false, fmt.Errorf("%w: the chain at slot %d runs into slot %d, which is not available", ErrBroken, start, i)
		}
		b := p.ring[int(i)*descSize:]
		addr, n := binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint32(b[8:])
		id = binary.LittleEndian.Uint16(b[12:])
		slots++
		if i++; i == q.size {
			i, w = 0, !w
		}
		if bad == nil {
			bad = p.buffer(q, c, addr, n, f, slots == 1)
		}
		if f&descNext == 0 {
			break
		}
	}
	p.availIdx, p.availWrap = i, w
	if q.eventIdx {
		p.setDeviceEvent(q) // the guest need not kick for what we are about to see
	}
	// The spec puts the buffer id in the chain's last descriptor.
	tok := Token(id) | Token(slots)<<16
	q.mu.Lock()
	switch {
	case slices.Contains(p.outstanding, id):
		tok |= untracked
		if bad == nil {
			bad = fmt.Errorf("buffer id %d is already in flight", id)
		}
	case len(p.outstanding) < cap(p.outstanding):
		p.outstanding = append(p.outstanding, id)
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

// buffer adds the buffer of one descriptor (flags f) to c: a direct
// buffer, or, for the chain's only descriptor, an indirect table.
func (p *packedRing) buffer(q *Queue, c *DescChain, addr uint64, n uint32, f uint16, first bool) error {
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

// push writes the used descriptor for tok at usedIdx and advances it by
// the chain's slots.
func (p *packedRing) push(q *Queue, tok Token, n uint32) {
	id, slots := uint16(tok), int(uint16(tok>>16))
	if tok&untracked == 0 {
		if k := slices.Index(p.outstanding, id); k >= 0 {
			last := len(p.outstanding) - 1
			p.outstanding[k] = p.outstanding[last]
			p.outstanding = p.outstanding[:last]
		}
	}
	off := int(p.usedIdx) * descSize
	d := p.ring[off : off+descSize]
	binary.LittleEndian.PutUint32(d[8:], n)
	var flags uint16
	if p.usedWrap {
		flags = packedAvail | packedUsed
	}
	if n > 0 {
		flags |= descWrite
	}
	// id and flags in one release store after len: the driver reads the
	// flags, then id and len.
	atomic.StoreUint32(word32(d[12:]), uint32(id)|uint32(flags)<<16)
	if q.log.Active() && q.usedLogOn.Load() {
		q.log.Mark(p.ringGPA+uint64(off)+8, 8)
	}
	slots = max(slots, 1)
	p.pushed += slots
	next := int(p.usedIdx) + slots
	if next >= int(q.size) {
		next -= int(q.size)
		p.usedWrap = !p.usedWrap
	}
	p.usedIdx = uint16(next)
}

// needNotify decides whether the used descriptors written since the last
// decision call for an interrupt, from the driver event area.
func (p *packedRing) needNotify(q *Queue) bool {
	if p.pushed == 0 {
		return false
	}
	q.fullBarrier()
	ev := atomic.LoadUint32(word32(p.driverEvent))
	offWrap, flags := uint16(ev), uint16(ev>>16)
	var need bool
	switch {
	case flags == eventDisable:
	case flags == eventDesc && q.eventIdx:
		need = !q.decided || p.needEvent(q, offWrap)
	default: // enabled (or DESC without EVENT_IDX, reserved): always
		need = true
	}
	p.signalled, p.sigWrap, p.pushed, q.decided = p.usedIdx, p.usedWrap, 0, true
	return need
}

// needEvent reports whether the driver's event position lies among the
// slots used since the last decision: [signalled, usedIdx) on a line where
// positions of the previous lap count size less.
func (p *packedRing) needEvent(q *Queue, offWrap uint16) bool {
	size := int(q.size)
	if p.pushed >= size {
		return true // a lap or more since the last decision: cannot tell
	}
	cur, old := int(p.usedIdx), int(p.signalled)
	if p.sigWrap != p.usedWrap {
		old -= size
	}
	ev := int(offWrap & 0x7fff)
	if (offWrap&0x8000 != 0) != p.usedWrap {
		ev -= size
	}
	return old <= ev && ev < cur
}
