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

// splitRing is the state only a split ring has. The consumer fields belong
// to the goroutine that pops; the producer fields are guarded by Queue.mu.
type splitRing struct {
	desc  []byte // descriptor table
	avail []byte // the driver's avail ring
	used  []byte // the device's used ring

	// Consumer state.
	lastAvail uint16 // next avail index to pop
	seenAvail uint16 // avail.idx at the last snapshot

	// Producer state.
	usedIdx   uint16 // next used index
	signalled uint16 // usedIdx at the last notification decision
}

func newSplitRing(cfg Config, mem *GuestMemory) (*splitRing, error) {
	n := uint64(cfg.Size)
	if n == 0 || n > MaxSize || n&(n-1) != 0 {
		return nil, fmt.Errorf("ring size %d is not a power of two in 1..%d", n, MaxSize)
	}
	if cfg.Base > 0xffff {
		return nil, fmt.Errorf("split ring base %#x beyond 16 bits", cfg.Base)
	}
	if cfg.DescAddr%16 != 0 || cfg.AvailAddr%2 != 0 || cfg.UsedAddr%4 != 0 {
		return nil, fmt.Errorf("ring addresses desc %#x avail %#x used %#x misaligned", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr)
	}
	s := &splitRing{}
	var ok1, ok2, ok3 bool
	s.desc, ok1 = mem.UserSlice(cfg.DescAddr, descSize*n)
	s.avail, ok2 = mem.UserSlice(cfg.AvailAddr, 6+2*n)
	s.used, ok3 = mem.UserSlice(cfg.UsedAddr, 6+8*n)
	if !ok1 || !ok2 || !ok3 {
		return nil, fmt.Errorf("ring desc %#x avail %#x used %#x (size %d) not inside one mapped region each", cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr, n)
	}
	s.lastAvail = uint16(cfg.Base)
	s.seenAvail = s.lastAvail // nothing seen yet
	// The used index is the ring's own: read it back.
	s.usedIdx = s.loadUsedIdx()
	s.signalled = s.usedIdx
	return s, nil
}

// base is the next avail index, SET_VRING_BASE's 16 bits.
func (s *splitRing) base() uint32 { return uint32(s.lastAvail) }

// loadAvailIdx reads avail.idx with acquire semantics: entries it covers are
// read after it. The {flags, idx} pair is read as one 32-bit word (Go has no
// 16-bit atomics); on amd64 a 2-aligned 4-byte load never tears a 16-bit half.
func (s *splitRing) loadAvailIdx() uint16 {
	return uint16(atomic.LoadUint32(word32(s.avail)) >> 16)
}

func (s *splitRing) loadAvailFlags() uint16 {
	return uint16(atomic.LoadUint32(word32(s.avail)))
}

func (s *splitRing) loadUsedIdx() uint16 {
	return uint16(atomic.LoadUint32(word32(s.used)) >> 16)
}

// pending reports whether the guest has published entries not yet popped.
func (s *splitRing) pending() bool { return s.loadAvailIdx() != s.lastAvail }

func (s *splitRing) waiting(q *Queue, limit int) int {
	return min(int(min(s.loadAvailIdx()-s.lastAvail, q.size)), limit)
}

// setAvailEvent tells the guest, with EVENT_IDX, to kick for entries past
// those popped.
func (s *splitRing) setAvailEvent(q *Queue) {
	off := 4 + 8*uint64(q.size) // avail_event follows the used entries
	binary.LittleEndian.PutUint16(s.used[off:], s.lastAvail)
	q.logUsed(off, 2)
}

func (s *splitRing) enableNotify(q *Queue) bool {
	if q.eventIdx {
		s.setAvailEvent(q)
	}
	q.fullBarrier()
	return s.pending()
}

func (s *splitRing) seen() bool { return s.seenAvail != s.lastAvail }

// snapshot reads avail.idx once: pop takes the entries up to it. An index
// further ahead than the ring holds leaves no way to know which entries
// are valid, and breaks the ring.
func (s *splitRing) snapshot(q *Queue) (bool, error) {
	availIdx := s.loadAvailIdx()
	pending := availIdx - s.lastAvail
	if pending > q.size {
		q.broken = true
		return false, fmt.Errorf("%w: avail index %d is %d entries past %d, ring has %d", ErrBroken, availIdx, pending, s.lastAvail, q.size)
	}
	s.seenAvail = availIdx
	return pending != 0, nil
}

func (s *splitRing) pop(q *Queue, c *DescChain) (bool, error) {
	slot := int(s.lastAvail & (q.size - 1))
	head := binary.LittleEndian.Uint16(s.avail[4+2*slot:])
	s.lastAvail++
	if q.eventIdx {
		// Let the guest skip kicks for what we are about to see anyway.
		s.setAvailEvent(q)
	}
	c.Token = Token(head)
	if head >= q.size {
		return true, fmt.Errorf("%w: head %d, ring size %d", ErrBadHead, head, q.size)
	}
	if err := s.walk(q, c, head); err != nil {
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
func (s *splitRing) walk(q *Queue, c *DescChain, head uint16) error {
	table := s.desc
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

func (s *splitRing) push(q *Queue, tok Token, n uint32) {
	slot := int(s.usedIdx & (q.size - 1))
	off := 4 + 8*slot
	e := s.used[off:]
	binary.LittleEndian.PutUint32(e[0:], uint32(uint16(tok)))
	binary.LittleEndian.PutUint32(e[4:], n)
	q.logUsed(uint64(off), 8)
	s.usedIdx++
	// Entries before index: the atomic store is a release (and on amd64 a
	// full barrier, which the EVENT_IDX check in needNotify relies on).
	// The device owns used.flags, which we keep at 0 (and write with the
	// index: they share the word).
	atomic.StoreUint32(word32(s.used), uint32(s.usedIdx)<<16)
	q.logUsed(0, 4)
}

// needNotify decides whether the entries used since the last decision
// call for an interrupt: with EVENT_IDX when the used index passed
// used_event, else unless the driver set NO_INTERRUPT.
func (s *splitRing) needNotify(q *Queue) bool {
	old, cur := s.signalled, s.usedIdx
	if old == cur {
		return false
	}
	q.fullBarrier()
	var need bool
	if q.eventIdx {
		usedEvent := binary.LittleEndian.Uint16(s.avail[4+2*int(q.size):])
		need = cur-usedEvent-1 < cur-old || !q.decided
	} else {
		need = s.loadAvailFlags()&availNoInterrupt == 0
	}
	s.signalled, q.decided = cur, true
	return need
}
