package virtqueue

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
)

// The split ring (virtio 1.2 §2.7): a descriptor table, the driver's avail
// ring {flags, idx, ring[size], used_event} and the device's used ring
// {flags, idx, ring[size] of {id, len}, avail_event}. Indices run free over
// 16 bits; a slot is an index modulo the size, a power of two.

// availNoInterrupt is the avail ring's VRING_AVAIL_F_NO_INTERRUPT.
const availNoInterrupt = 1

func (q *Queue) splitInit(cfg Config, mem *GuestMemory) error {
	n := uint64(cfg.Size)
	if n == 0 || n > MaxSize || n&(n-1) != 0 {
		return fmt.Errorf("ring size %d is not a power of two in 1..%d", n, MaxSize)
	}
	if cfg.Base > 0xffff {
		return fmt.Errorf("split ring base %#x beyond 16 bits", cfg.Base)
	}
	if cfg.DescAddr%16 != 0 || cfg.AvailAddr%2 != 0 || cfg.UsedAddr%4 != 0 {
		return fmt.Errorf("ring addresses desc %#x avail %#x used %#x misaligned", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr)
	}
	var ok1, ok2, ok3 bool
	q.desc, ok1 = mem.UserSlice(cfg.DescAddr, descSize*n)
	q.avail, ok2 = mem.UserSlice(cfg.AvailAddr, 6+2*n)
	q.used, ok3 = mem.UserSlice(cfg.UsedAddr, 6+8*n)
	if !ok1 || !ok2 || !ok3 {
		return fmt.Errorf("ring desc %#x avail %#x used %#x (size %d) not inside one mapped region each", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr, n)
	}
	q.lastAvail = uint16(cfg.Base)
	q.seenAvail = q.lastAvail // nothing seen yet
	// The used index is the ring's own: read it back.
	q.usedIdx = q.loadUsedIdx()
	q.signalled = q.usedIdx
	return nil
}

// availEventOffset is where avail_event sits in the used ring.
func (q *Queue) availEventOffset() int { return 4 + 8*int(q.size) }

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

func (q *Queue) splitEnableNotify() bool {
	if q.eventIdx {
		off := q.availEventOffset()
		binary.LittleEndian.PutUint16(q.used[off:], q.lastAvail)
		q.logUsed(uint64(off), 2)
	}
	q.fullBarrier()
	return q.loadAvailIdx() != q.lastAvail
}

func (q *Queue) splitSnapshot() (bool, error) {
	availIdx := q.loadAvailIdx()
	pending := availIdx - q.lastAvail
	if pending > q.size {
		q.broken = true
		return false, fmt.Errorf("%w: avail index %d is %d entries past %d, ring has %d", ErrBroken, availIdx, pending, q.lastAvail, q.size)
	}
	q.seenAvail = availIdx
	return pending != 0, nil
}

func (q *Queue) splitPop(c *DescChain) (bool, error) {
	slot := int(q.lastAvail & (q.size - 1))
	head := binary.LittleEndian.Uint16(q.avail[4+2*slot:])
	q.lastAvail++
	if q.eventIdx {
		// Let the guest skip kicks for what we are about to see anyway.
		off := q.availEventOffset()
		binary.LittleEndian.PutUint16(q.used[off:], q.lastAvail)
		q.logUsed(uint64(off), 2)
	}
	c.Token = Token(head)
	if head >= q.size {
		return true, fmt.Errorf("%w: head %d, ring size %d", ErrBadHead, head, q.size)
	}
	if err := q.walk(c, head); err != nil {
		return true, fmt.Errorf("%w: head %d: %v", ErrBadChain, head, err)
	}
	return true, nil
}

// descriptor is one split descriptor read once from guest memory.
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

// walk follows the split chain at head, appending its buffers to c. Every
// step is bounded: a chain visits at most as many descriptors as its table
// holds, which also catches loops.
func (q *Queue) walk(c *DescChain, head uint16) error {
	table := q.desc
	entries := int(q.size)
	idx := int(head)
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
			case inIndirect:
				return errors.New("indirect descriptor inside an indirect table")
			case d.flags&descNext != 0:
				return errors.New("indirect descriptor with NEXT set")
			}
			if err := q.indirectCheck(d.len); err != nil {
				return err
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

func (q *Queue) splitPush(tok Token, n uint32) {
	slot := int(q.usedIdx & (q.size - 1))
	off := 4 + 8*slot
	e := q.used[off:]
	binary.LittleEndian.PutUint32(e[0:], uint32(uint16(tok)))
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

func (q *Queue) splitNeedNotify() bool {
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
