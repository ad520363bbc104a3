package vmm

import (
	"fmt"
	"slices"
)

// Malformation is a way a driver can break the ring rules, for negative
// tests. Each one is applied to an otherwise valid FUSE request. Most apply
// to one layout only: Malformations lists the split ring's, and
// PackedMalformations the packed ring's; Reaction says what a correct
// device does.
type Malformation int

const (
	// BadLoop: a direct chain whose last descriptor has NEXT back to the head.
	BadLoop Malformation = iota
	// BadNextOutOfRange: the head's next is Size.
	BadNextOutOfRange
	// BadHeadOutOfRange: the avail ring names head Size+1.
	BadHeadOutOfRange
	// BadAddrOutside: a buffer at a guest-physical address that is not RAM
	// (just past the highest region).
	BadAddrOutside
	// BadAddrOverflow: a buffer at 2^64-8 of 16+ bytes, so addr+len wraps
	// into region 0 (a naive "addr+len <= end" check passes).
	BadAddrOverflow
	// BadIndirectNext: the indirect descriptor also has NEXT, to a valid
	// descriptor.
	BadIndirectNext
	// BadIndirectNested: an indirect table whose first entry is INDIRECT.
	BadIndirectNested
	// BadIndirectLenZero: an indirect descriptor of length 0.
	BadIndirectLenZero
	// BadIndirectLenOdd: an indirect descriptor whose length is not a
	// multiple of 16.
	BadIndirectLenOdd
	// BadIndirectHuge: an indirect descriptor of length 0xfffffff0.
	BadIndirectHuge
	// BadIndirectTooLong: a valid indirect table of Size+1 entries (the
	// chain is longer than the ring).
	BadIndirectTooLong
	// BadReadAfterWrite: a readable descriptor after a writable one.
	BadReadAfterWrite
	// BadZeroLength: the fuse_in_header descriptor has length 0.
	BadZeroLength
	// BadAvailJump: avail.idx moves by Size+1 (no chain is returned).
	BadAvailJump

	// The kinds below came with packed rings; Malformations, the list the
	// split tests run, does not include them.

	// BadIndirectOutside: an indirect descriptor whose table lies at a
	// guest-physical address that is not RAM. It applies to split rings
	// too.
	BadIndirectOutside
	// BadDuplicateID (packed): the request is made available twice, the
	// second chain with the buffer id of the first while that one is in
	// flight; the second is returned by AddMalformed and the first is its
	// Original. A device that still holds the first when it reads the
	// second returns the second with len 0 and the first normally; one
	// that has already returned the first when it reads the second may
	// take the second as new and answer it. The two take the same number
	// of slots, so the ring stays in step either way. To make the outcome
	// certain, use a request the device cannot complete at once (a SETLKW
	// on a lock another owner holds).
	BadDuplicateID
	// BadChainTooLong (packed): a direct chain over every slot of the
	// ring, each made available with NEXT, the last too (the request's
	// readable buffers, then one-byte readable buffers over its header).
	// It needs an idle ring.
	BadChainTooLong
	// BadChainUnterminated (packed): a direct chain whose last descriptor
	// has NEXT into a slot that is not made available (it holds what the
	// device left there in the previous lap). The driver reserves that
	// slot too.
	BadChainUnterminated
)

var malformationNames = []string{
	"loop", "next-out-of-range", "head-out-of-range", "addr-outside", "addr-overflow",
	"indirect-next", "indirect-nested", "indirect-len-zero", "indirect-len-odd",
	"indirect-huge", "indirect-too-long", "read-after-write", "zero-length", "avail-jump",
	"indirect-outside", "duplicate-id", "chain-too-long", "chain-unterminated",
}

func (m Malformation) String() string {
	if int(m) < len(malformationNames) {
		return malformationNames[m]
	}
	return fmt.Sprintf("malformation-%d", int(m))
}

// Malformations lists the split-ring kinds: every kind up to BadAvailJump.
func Malformations() []Malformation {
	var all []Malformation
	for m := range BadAvailJump + 1 {
		all = append(all, m)
	}
	return all
}

// PackedMalformations lists the kinds that apply to a packed ring. Those
// of the split ring that name a next field, an avail ring or nested
// tables do not: a packed ring has none, and NEXT or INDIRECT inside a
// packed indirect table are reserved and ignored by the device.
func PackedMalformations() []Malformation {
	return []Malformation{
		BadAddrOutside, BadAddrOverflow, BadIndirectNext, BadIndirectLenZero, BadIndirectLenOdd,
		BadIndirectHuge, BadIndirectTooLong, BadIndirectOutside, BadReadAfterWrite, BadZeroLength,
		BadDuplicateID, BadChainTooLong, BadChainUnterminated,
	}
}

// Reaction is what a correct device does with a malformed chain.
type Reaction int

const (
	// ReturnedEmpty: the chain comes back as used with len 0 under its
	// id (on a packed ring with the used index moved by the slots the
	// chain took, so that later requests still complete), and the ring
	// goes on serving.
	ReturnedEmpty Reaction = iota
	// NotReturned: there is no chain to return (a head out of range);
	// the ring goes on serving.
	NotReturned
	// RingBroken: the device stops serving the ring, without crashing,
	// until the ring is set up again (RestartQueue with a new ring, or a
	// guest reset); the other rings go on.
	RingBroken
)

func (r Reaction) String() string {
	switch r {
	case ReturnedEmpty:
		return "returned-empty"
	case NotReturned:
		return "not-returned"
	case RingBroken:
		return "ring-broken"
	}
	return fmt.Sprintf("reaction-%d", int(r))
}

// Reaction is what a correct device does with a chain broken as m says.
func (m Malformation) Reaction() Reaction {
	switch m {
	case BadHeadOutOfRange:
		return NotReturned
	case BadAvailJump, BadChainTooLong, BadChainUnterminated:
		return RingBroken
	}
	return ReturnedEmpty
}

// Original is, for a BadDuplicateID chain, the valid request whose id it
// reuses; nil otherwise.
func (c *Chain) Original() *FuseCall { return c.orig }

// Unmapped returns a page-aligned guest-physical address that is not RAM:
// the first page after the highest region.
func (m *Memory) Unmapped() uint64 {
	var end uint64
	for _, r := range m.regions {
		end = max(end, r.End())
	}
	return end + PageSize
}

// AddMalformed lays out r (a valid FUSE request) in guest memory, breaks it
// as kind says, and makes it available without notifying. It returns the
// chain to wait on (nil for BadAvailJump). A correct device either fails
// the request or stops using the ring, as kind.Reaction says; it must
// never touch memory outside the request's buffers, return an id twice, or
// crash.
func (q *Queue) AddMalformed(kind Malformation, r FuseRequest) (*Chain, error) {
	if q.Packed() {
		return q.addMalformedPacked(kind, r)
	}
	if kind > BadIndirectOutside {
		return nil, fmt.Errorf("vmm: %v applies to packed rings only", kind)
	}
	if kind == BadAvailJump {
		q.SetAvailIdx(q.AvailIdx() + q.Size() + 1)
		return nil, nil
	}
	if kind == BadHeadOutOfRange {
		return q.AddRaw(q.Size()+1, nil, 0), nil
	}
	segs, _, err := q.fuseSegments(r)
	if err != nil {
		return nil, err
	}
	ds := make([]Desc, len(segs))
	for i, s := range segs {
		ds[i] = Desc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags = DescWrite
		}
	}
	switch kind {
	case BadAddrOutside:
		ds[0].Addr = q.mem.Unmapped()
	case BadAddrOverflow:
		ds[0].Addr = ^uint64(0) - 7
	case BadReadAfterWrite:
		// Move the first writable descriptor in front of the last readable.
		w := -1
		for i, d := range ds {
			if d.Flags&DescWrite != 0 {
				w = i
				break
			}
		}
		if w < 1 {
			return nil, fmt.Errorf("vmm: %v needs readable and writable parts", kind)
		}
		ds[w-1], ds[w] = ds[w], ds[w-1]
	case BadZeroLength:
		ds[0].Len = 0
	}

	// Direct chains.
	switch kind {
	case BadLoop, BadNextOutOfRange, BadAddrOutside, BadAddrOverflow, BadReadAfterWrite, BadZeroLength:
		ids, err := q.AllocDescs(len(ds))
		if err != nil {
			return nil, err
		}
		for i := range ds {
			if i+1 < len(ds) {
				ds[i].Flags |= DescNext
				ds[i].Next = ids[i+1]
			}
		}
		switch kind {
		case BadLoop:
			last := len(ds) - 1
			ds[last].Flags |= DescNext
			ds[last].Next = ids[0]
		case BadNextOutOfRange:
			ds[0].Flags |= DescNext
			ds[0].Next = q.Size()
		}
		for i, d := range ds {
			q.WriteDesc(ids[i], d)
		}
		return q.AddRaw(ids[0], ids, 0), nil
	}

	// Indirect chains.
	for i := range ds[:len(ds)-1] {
		ds[i].Flags |= DescNext
		ds[i].Next = uint16(i + 1)
	}
	if kind == BadIndirectTooLong {
		// Pad the table to Size+1 entries with readable one-byte
		// descriptors over the header buffer, before the writable part.
		var rd, wr []Desc
		for _, d := range ds {
			if d.Flags&DescWrite != 0 {
				wr = append(wr, d)
			} else {
				rd = append(rd, d)
			}
		}
		for len(rd)+len(wr) < int(q.Size())+1 {
			rd = append(rd, Desc{Addr: segs[0].Addr, Len: 1})
		}
		ds = append(rd, wr...)
		for i := range ds {
			ds[i].Flags &^= DescNext
			if i+1 < len(ds) {
				ds[i].Flags |= DescNext
				ds[i].Next = uint16(i + 1)
			}
		}
	}
	tableLen := uint64(len(ds)) * DescSize
	if kind == BadIndirectNested {
		tableLen *= 2
	}
	table, err := q.mem.AllocIn(q.bufRegion(), tableLen+DescSize, DescSize)
	if err != nil {
		return nil, err
	}
	if kind == BadIndirectNested {
		inner := table + uint64(len(ds))*DescSize
		if err := q.WriteTable(inner, ds); err != nil {
			return nil, err
		}
		ds = []Desc{{Addr: inner, Len: uint32(len(ds)) * DescSize, Flags: DescIndirect}}
	}
	if err := q.WriteTable(table, ds); err != nil {
		return nil, err
	}
	head := Desc{Addr: table, Len: uint32(len(ds)) * DescSize, Flags: DescIndirect}
	n := 1
	switch kind {
	case BadIndirectLenZero:
		head.Len = 0
	case BadIndirectLenOdd:
		head.Len += 8
	case BadIndirectHuge:
		head.Len = 0xfffffff0
	case BadIndirectOutside:
		head.Addr = q.mem.Unmapped()
	case BadIndirectNext:
		n = 2
	}
	ids, err := q.AllocDescs(n)
	if err != nil {
		return nil, err
	}
	if kind == BadIndirectNext {
		head.Flags |= DescNext
		head.Next = ids[1]
		q.WriteDesc(ids[1], Desc{Addr: segs[len(segs)-1].Addr, Len: segs[len(segs)-1].Len, Flags: DescWrite})
	}
	q.WriteDesc(ids[0], head)
	// The table is deliberately not handed to AddRaw: a broken device may
	// still read it after returning the chain.
	return q.AddRaw(ids[0], ids, 0), nil
}

// addMalformedPacked is AddMalformed on a packed ring.
func (q *Queue) addMalformedPacked(kind Malformation, r FuseRequest) (*Chain, error) {
	if !slices.Contains(PackedMalformations(), kind) {
		return nil, fmt.Errorf("vmm: %v does not apply to a packed ring", kind)
	}
	if kind == BadDuplicateID {
		return q.addDuplicate(r)
	}
	segs, _, err := q.fuseSegments(r)
	if err != nil {
		return nil, err
	}
	ds := make([]PackedDesc, len(segs))
	var rd, wr []PackedDesc
	var wlen uint32
	for i, s := range segs {
		ds[i] = PackedDesc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags = DescWrite
			wlen += s.Len
			wr = append(wr, ds[i])
		} else {
			rd = append(rd, ds[i])
		}
	}
	switch kind {
	case BadAddrOutside:
		ds[0].Addr = q.mem.Unmapped()
	case BadAddrOverflow:
		ds[0].Addr = ^uint64(0) - 7
	case BadZeroLength:
		ds[0].Len = 0
	case BadReadAfterWrite:
		if len(rd) == 0 || len(wr) == 0 {
			return nil, fmt.Errorf("vmm: %v needs readable and writable parts", kind)
		}
		// The first writable descriptor in front of the last readable.
		w := len(rd)
		ds[w-1], ds[w] = ds[w], ds[w-1]
	case BadChainTooLong:
		ds = rd
		for len(ds) < int(q.Size()) {
			ds = append(ds, PackedDesc{Addr: segs[0].Addr, Len: 1})
		}
		ds = ds[:q.Size()]
		wlen = 0
	case BadIndirectTooLong:
		// A valid table of Size+1 entries: one-byte readable entries
		// over the header between the readable and writable parts.
		ds = rd
		for len(ds)+len(wr) < int(q.Size())+1 {
			ds = append(ds, PackedDesc{Addr: segs[0].Addr, Len: 1})
		}
		ds = append(ds, wr...)
	}

	switch kind {
	case BadAddrOutside, BadAddrOverflow, BadZeroLength, BadReadAfterWrite, BadChainTooLong, BadChainUnterminated:
		for i := range ds[:len(ds)-1] {
			ds[i].Flags |= DescNext
		}
		hold := 0
		if kind == BadChainTooLong || kind == BadChainUnterminated {
			ds[len(ds)-1].Flags |= DescNext
		}
		if kind == BadChainUnterminated {
			hold = 1
		}
		q.mu.Lock()
		defer q.mu.Unlock()
		id, err := q.allocSlots(len(ds) + hold)
		if err != nil {
			return nil, fmt.Errorf("vmm: %v needs %d free slots: %w", kind, len(ds)+hold, err)
		}
		for i := range ds {
			ds[i].ID = id
		}
		c := q.newPackedChain(id, len(ds)+hold, 0, wlen)
		q.publishPacked(ds, hold)
		q.trackPacked(c, false)
		return c, nil
	}

	// Indirect chains: the table holds ds (packed tables have no NEXT).
	table, err := q.mem.AllocIn(q.bufRegion(), uint64(len(ds))*DescSize+DescSize, DescSize)
	if err != nil {
		return nil, err
	}
	if err := q.WritePackedTable(table, ds); err != nil {
		return nil, err
	}
	head := []PackedDesc{{Addr: table, Len: uint32(len(ds)) * DescSize, Flags: DescIndirect}}
	switch kind {
	case BadIndirectLenZero:
		head[0].Len = 0
	case BadIndirectLenOdd:
		head[0].Len += 8
	case BadIndirectHuge:
		head[0].Len = 0xfffffff0
	case BadIndirectOutside:
		head[0].Addr = q.mem.Unmapped()
	case BadIndirectNext:
		// NEXT on the indirect descriptor, to a writable buffer.
		head[0].Flags |= DescNext
		last := segs[len(segs)-1]
		head = append(head, PackedDesc{Addr: last.Addr, Len: last.Len, Flags: DescWrite})
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	id, err := q.allocSlots(len(head))
	if err != nil {
		return nil, err
	}
	// The table is deliberately not freed with the chain: a broken
	// device may still read it after returning the chain.
	return q.addChainLocked(packedChain{ds: head, wlen: wlen}, id, false), nil
}

// addDuplicate lays r out twice, as Add would, and makes both copies
// available back to back under one id, so that the device reads the
// second while the first is still in flight unless it completes requests
// faster than it reads descriptors.
func (q *Queue) addDuplicate(r FuseRequest) (*Chain, error) {
	segs, bufs, err := q.fuseSegments(r)
	if err != nil {
		return nil, err
	}
	first, err := q.layoutChain(segs, r.Indirect)
	if err != nil {
		return nil, err
	}
	segs2, _, err := q.fuseSegments(r)
	if err != nil {
		return nil, err
	}
	second, err := q.layoutChain(segs2, r.Indirect)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	id, err := q.allocSlots(2 * len(first.ds))
	if err != nil {
		return nil, err
	}
	orig := q.newFuseCall(q.addChainLocked(first, id, false), segs, bufs)
	second.table = 0 // the device may read it after rejecting the chain
	dup := q.addChainLocked(second, id, true)
	dup.orig = orig
	return dup, nil
}
