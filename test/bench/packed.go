package bench

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// The packed ring's driver side (virtio 1.2 §2.8), one slot per request:
// Ring.availIdx is the next slot to fill, Ring.lastUsed the next slot to
// read a used descriptor at, each with its wrap counter here. Ring.avail
// is the driver event area, Ring.used the device event area.
type packedDriver struct {
	heads    []vmm.Desc // what Add(i) writes: SetDesc(i)
	wrap     bool       // driver's avail wrap counter at availIdx
	usedWrap bool       // driver's used wrap counter at lastUsed
}

const (
	pAvail = 1 << 7
	pUsed  = 1 << 15

	eventEnable = 0
	eventDesc   = 2
)

// packedPos packs a slot and its wrap counter as the event areas do.
func packedPos(slot uint16, wrap bool) uint16 {
	if wrap {
		return slot | 0x8000
	}
	return slot
}

// newPackedRing takes over ring q of a packed device that stopped at base
// (GET_VRING_BASE: next avail slot and wrap, next used slot and wrap).
func newPackedRing(mem *vmm.Memory, q *vmm.Queue, eventIdx bool, base uint32) (*Ring, error) {
	size := q.Size()
	availSlot, usedSlot := uint16(base&0x7fff), uint16(base>>16&0x7fff)
	if availSlot != usedSlot || base&0x8000 != base>>16&0x8000 {
		return nil, fmt.Errorf("bench: ring %d stopped at %#x with chains in flight", q.Index, base)
	}
	a := q.Addrs()
	r := &Ring{Index: q.Index, size: size, eventIdx: eventIdx, availIdx: availSlot, lastUsed: usedSlot, kickFd: -1, call: -1}
	r.packed = &packedDriver{heads: make([]vmm.Desc, size), wrap: base&0x8000 != 0, usedWrap: base&0x8000_0000 != 0}
	var err error
	if r.desc, err = mem.Slice(a.Desc, uint64(size)*vmm.DescSize); err != nil {
		return nil, err
	}
	if r.avail, err = mem.Slice(a.Avail, 4); err != nil {
		return nil, err
	}
	if r.used, err = mem.Slice(a.Used, 4); err != nil {
		return nil, err
	}
	if a.Desc%16 != 0 || a.Avail%4 != 0 || a.Used%4 != 0 {
		return nil, fmt.Errorf("bench: packed ring %d areas misaligned", q.Index)
	}
	return r, r.openFds()
}

func word32(b []byte) *uint32 { return (*uint32)(unsafe.Pointer(&b[0])) }

// add writes head's descriptor into the next slot: address and length,
// then id and flags in one release store.
func (p *packedDriver) add(r *Ring, head uint16) {
	d := p.heads[head]
	b := r.desc[int(r.availIdx)*vmm.DescSize:]
	le.PutUint64(b, d.Addr)
	le.PutUint32(b[8:], d.Len)
	flags := d.Flags &^ vmm.DescNext
	if p.wrap {
		flags |= pAvail
	} else {
		flags |= pUsed
	}
	atomic.StoreUint32(word32(b[12:]), uint32(head)|uint32(flags)<<16)
	r.availIdx, p.wrap = p.advance(r.availIdx, p.wrap, 1, r.size)
}

// advance returns slot+n with its wrap counter.
func (p *packedDriver) advance(slot uint16, wrap bool, n int, size uint16) (uint16, bool) {
	s := int(slot) + n
	for s >= int(size) {
		s -= int(size)
		wrap = !wrap
	}
	return uint16(s), wrap
}

// needKick decides, after r.pending slots were added, whether the device
// asked for a kick (Linux's virtqueue_kick_prepare_packed). The stores of
// add were release stores; the XCHG-strength barrier orders them before
// the read of the device event area.
func (p *packedDriver) needKick(r *Ring) bool {
	atomic.AddUint32(word32(r.avail), 0) // full barrier (LOCK XADD on our own area)
	ev := atomic.LoadUint32(word32(r.used))
	offWrap, flags := uint16(ev), uint16(ev>>16)
	if flags != eventDesc {
		return flags == eventEnable
	}
	cur := int(r.availIdx)
	old := cur - int(r.pending)
	off := int(offWrap & 0x7fff)
	if (offWrap&0x8000 != 0) != p.wrap {
		off -= int(r.size)
	}
	return old <= off && off < cur
}

// usedAt reports whether the device has written a used descriptor at slot
// under the used wrap counter wrap.
func (p *packedDriver) usedAt(r *Ring, slot uint16, wrap bool) bool {
	f := uint16(atomic.LoadUint32(word32(r.desc[int(slot)*vmm.DescSize+12:])) >> 16)
	return (f&pAvail != 0) == wrap && (f&pUsed != 0) == wrap
}

func (p *packedDriver) next(r *Ring) (id, n uint32, ok bool) {
	if !p.usedAt(r, r.lastUsed, p.usedWrap) {
		return 0, 0, false
	}
	b := r.desc[int(r.lastUsed)*vmm.DescSize:]
	id, n = uint32(le.Uint16(b[12:])), le.Uint32(b[8:])
	r.lastUsed, p.usedWrap = p.advance(r.lastUsed, p.usedWrap, 1, r.size)
	return id, n, true
}

// armInterrupt asks for an interrupt once the used descriptor at (ev,
// evWrap) is written (EVENT_IDX; without it, at every one), and reports
// whether it already is (then the caller must not sleep).
func (p *packedDriver) armInterrupt(r *Ring, ev uint16, evWrap bool) bool {
	v := uint32(eventEnable) << 16
	if r.eventIdx {
		v = uint32(packedPos(ev, evWrap)) | eventDesc<<16
	}
	atomic.SwapUint32(word32(r.avail), v) // a full barrier before the re-check
	return p.usedAt(r, ev, evWrap)
}

func (p *packedDriver) diag(r *Ring) string {
	drv, dev := atomic.LoadUint32(word32(r.avail)), atomic.LoadUint32(word32(r.used))
	waits := "driver not asleep"
	if r.asleep.Load() {
		v := uint16(r.sleep.Load())
		waits = fmt.Sprintf("driver asleep waiting for slot %d (wrap %v)", v&0x7fff, v&0x8000 != 0)
	}
	return fmt.Sprintf("packed ring %d: next avail %d (wrap %v), next used %d (wrap %v), driver event %#x, device event %#x, %s",
		r.Index, r.availIdx, p.wrap, r.lastUsed, p.usedWrap, drv, dev, waits)
}
