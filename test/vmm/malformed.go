package vmm

import "fmt"

// Malformation is a way a driver can break the split-ring rules, for
// negative tests. Each one is applied to an otherwise valid FUSE request.
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
)

var malformationNames = []string{
	"loop", "next-out-of-range", "head-out-of-range", "addr-outside", "addr-overflow",
	"indirect-next", "indirect-nested", "indirect-len-zero", "indirect-len-odd",
	"indirect-huge", "indirect-too-long", "read-after-write", "zero-length", "avail-jump",
}

func (m Malformation) String() string {
	if int(m) < len(malformationNames) {
		return malformationNames[m]
	}
	return fmt.Sprintf("malformation-%d", int(m))
}

// Malformations lists every kind.
func Malformations() []Malformation {
	var all []Malformation
	for m := range Malformation(len(malformationNames)) {
		all = append(all, m)
	}
	return all
}

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
// the request or stops using the ring; it must never touch memory outside
// the request's buffers, return an id twice, or crash.
func (q *Queue) AddMalformed(kind Malformation, r FuseRequest) (*Chain, error) {
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
