package virtqueue

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Fuzz input layout (missing bytes read as zero):
//
//	[0]      features: bit 0 INDIRECT_DESC, bit 1 EVENT_IDX;
//	         bits 2-5: log2 of the ring size, mod 9 (sizes 1..256)
//	[1:3]    le16 AvailBase (the device's first avail index)
//	[3]      how far avail.idx is ahead of AvailBase
//	[4:6]    le16 used_event
//	then     the descriptor table (16*Q bytes), the avail ring (2*Q
//	         bytes), and the rest: the table written at fuzzTableGPA,
//	         where the first 16 entries lie in region A and the rest in
//	         the GPA-adjacent region B.
const fuzzTableGPA = gpaB - 0x100

// fuzzInput is a fuzz input read as a header of fixed bytes, read by index,
// then areas taken in order; missing bytes read as zero.
type fuzzInput struct {
	data []byte // the whole input
	rest []byte // what follows the header and the areas taken so far
}

func newFuzzInput(data []byte, header int) *fuzzInput {
	return &fuzzInput{data: data, rest: data[min(header, len(data)):]}
}

// at returns header byte i.
func (in *fuzzInput) at(i int) byte {
	if i < len(in.data) {
		return in.data[i]
	}
	return 0
}

// take returns the next n bytes after the header.
func (in *fuzzInput) take(n int) []byte {
	b := make([]byte, n)
	c := copy(b, in.rest)
	in.rest = in.rest[c:]
	return b
}

// checkSegments fails t unless each side of c holds at most maxSegs
// segments, each of them mapped guest memory at its own address.
func checkSegments(t *testing.T, g *guest, c *DescChain, maxSegs int) {
	t.Helper()
	for _, v := range [][]bufvec.Segment{c.Readable.Segments(), c.Writable.Segments()} {
		if len(v) > maxSegs {
			t.Fatalf("%d segments, limit %d", len(v), maxSegs)
		}
		for i := range v {
			s := &v[i]
			if s.Len == 0 || !s.Mapped() || len(s.Buf) != int(s.Len) || cap(s.Buf) != int(s.Len) {
				t.Fatalf("bad segment %#x+%#x (buf %d, cap %d)", s.GPA, s.Len, len(s.Buf), cap(s.Buf))
			}
			if !g.inside(s.Buf) {
				t.Fatalf("segment %#x+%#x outside guest memory", s.GPA, s.Len)
			}
			if b, ok := g.mem.Slice(s.GPA, uint64(s.Len)); !ok || !sameBytes(b, s.Buf) {
				t.Fatalf("segment %#x+%#x is not the guest memory at its address", s.GPA, s.Len)
			}
		}
	}
}

type fuzzRing struct {
	features   byte
	log2       byte
	base       uint16
	delta      byte
	usedEvent  uint16
	descs      []desc
	heads      []uint16
	indirTable []desc
}

func (f fuzzRing) bytes() []byte {
	q := 1 << f.log2
	b := []byte{f.features | f.log2<<2, 0, 0, f.delta, 0, 0}
	binary.LittleEndian.PutUint16(b[1:], f.base)
	binary.LittleEndian.PutUint16(b[4:], f.usedEvent)
	table := make([]byte, 16*q)
	for i, d := range f.descs {
		copy(table[16*i:], d.bytes())
	}
	avail := make([]byte, 2*q)
	for i, h := range f.heads {
		binary.LittleEndian.PutUint16(avail[2*((int(f.base)+i)%q):], h)
	}
	b = append(append(b, table...), avail...)
	for _, d := range f.indirTable {
		b = append(b, d.bytes()...)
	}
	return b
}

// fuzzSeeds are the FuzzChainWalk seeds; testdata/fuzz/FuzzChainWalk holds
// more.
func fuzzSeeds() []fuzzRing {
	return []fuzzRing{
		// A direct FUSE request: header + arguments readable, reply writable.
		{features: 3, log2: 3, delta: 2, usedEvent: 0,
			descs: []desc{{0x1000, 40, descNext, 1}, {0x1100, 16, descNext, 2}, {0x2000, 16, descWrite | descNext, 3}, {0x2100, 4096, descWrite, 0}},
			heads: []uint16{0, 0}},
		// An indirect chain whose table straddles regions A and B, with a
		// buffer that straddles them too.
		{features: 1, log2: 5, base: 0xfffe, delta: 3,
			descs: []desc{{fuzzTableGPA, 20 * 16, descIndirect, 0}, {gpaB - 8, 16, 0, 0}},
			heads: []uint16{0, 1, 0},
			indirTable: func() []desc {
				var t []desc
				for i := uint16(0); i < 19; i++ {
					t = append(t, desc{0x4000 + uint64(i)*0x1000, 4096, descNext, i + 1})
				}
				t[17].flags |= descWrite
				t[18].flags |= descWrite
				return append(t, desc{0xfff0, 0x20, descWrite, 0})
			}()},
		// Malformed: a loop, a bad head, a nested indirect.
		{features: 1, log2: 2, delta: 4,
			descs:      []desc{{0x1000, 8, descNext, 1}, {0x1000, 8, descNext, 0}, {fuzzTableGPA, 32, descIndirect, 0}},
			heads:      []uint16{0, 7, 2, 1},
			indirTable: []desc{{0x1000, 8, descNext, 1}, {fuzzTableGPA, 16, descIndirect, 0}}},
		// avail.idx jumps past the ring.
		{features: 2, log2: 1, delta: 3},
		// The largest ring, a chain of every descriptor.
		{features: 3, log2: 8, delta: 1,
			descs: func() []desc {
				var t []desc
				for i := range uint16(256) {
					t = append(t, desc{uint64(i) * 0x100, 0x100, descNext, i + 1})
				}
				t[255].flags = descWrite
				return t
			}(),
			heads: []uint16{0}},
	}
}

// FuzzChainWalk lays fuzz bytes out as a ring's descriptor table, avail
// ring and an indirect table, with fuzz-chosen features and ring size, and
// pops until the ring is empty or broken. Pop must terminate, never panic,
// and return only segments inside guest memory, within the chain's bounds.
func FuzzChainWalk(f *testing.F) {
	for _, s := range fuzzSeeds() {
		f.Add(s.bytes())
	}
	g := newGuest(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		in := newFuzzInput(data, 6)
		size := uint16(1) << ((in.at(0) >> 2 & 0xf) % 9)
		Q := int(size)
		base := uint16(in.at(1)) | uint16(in.at(2))<<8
		delta := uint16(in.at(3))
		usedEvent := uint16(in.at(4)) | uint16(in.at(5))<<8

		g.t = t
		// Start from the same memory every time: the fuzz may point
		// descriptors or tables anywhere in the ring area.
		g.write(ringDesc, make([]byte, 16*256))
		g.write(ringAvail, make([]byte, 6+2*256))
		g.write(ringUsed, make([]byte, 6+8*256))
		r := newRing(g, size)
		r.indirect = in.at(0)&1 != 0
		r.eventIdx = in.at(0)&2 != 0
		r.availIdx = base
		g.write(r.desc, in.take(16*Q))
		g.write(r.avail+4, in.take(2*Q))
		r.setAvailIdx(base + delta)
		r.setUsedEvent(usedEvent)
		table := in.take(min(len(in.rest), 16*256+16))
		g.write(fuzzTableGPA, table)
		defer g.write(fuzzTableGPA, make([]byte, len(table)))

		q, err := New(r.config(), g.mem)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		defer q.Close()
		c := NewDescChain(size)
		maxSegs := Q + regionSplits
		pushed := uint16(0)
		for pops := 0; ; pops++ {
			if pops > int(delta) {
				t.Fatalf("Pop returned %d chains, only %d published", pops, delta)
			}
			before := lastAvail(q)
			ok, err := q.Pop(c, g.mem)
			if !ok {
				if err != nil && !errors.Is(err, ErrBroken) {
					t.Fatalf("Pop: not ok with %v", err)
				}
				wantBroken := delta > size
				if errors.Is(err, ErrBroken) != wantBroken || q.Broken() != wantBroken {
					t.Fatalf("Pop: %v with avail idx %d ahead of a ring of %d", err, delta, size)
				}
				if err == nil && lastAvail(q) != base+delta {
					t.Fatalf("empty at %d, avail idx %d", lastAvail(q), base+delta)
				}
				break
			}
			if lastAvail(q) != before+1 {
				t.Fatalf("Pop moved LastAvail from %d to %d", before, lastAvail(q))
			}
			if r.eventIdx && r.availEvent() != lastAvail(q) {
				t.Fatalf("avail_event %d, LastAvail %d", r.availEvent(), lastAvail(q))
			}
			switch {
			case err == nil, errors.Is(err, ErrBadChain):
				if int(c.ID()) >= Q {
					t.Fatalf("head %d of a ring of %d accepted (%v)", c.ID(), Q, err)
				}
				q.Push(c.Token, 0)
				pushed++
			case errors.Is(err, ErrBadHead):
				if int(c.ID()) < Q {
					t.Fatalf("head %d reported out of range", c.ID())
				}
			default:
				t.Fatalf("Pop: unexpected error %v", err)
			}
			if err != nil {
				continue // the segments of a refused chain are not used
			}
			checkSegments(t, g, c, maxSegs)
			c.Release()
		}
		if err := q.Notify(); err != nil {
			t.Fatal(err)
		}
		if r.usedIdx() != pushed {
			t.Fatalf("used idx %d after %d pushes", r.usedIdx(), pushed)
		}
	})
}
