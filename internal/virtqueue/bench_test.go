package virtqueue

import (
	"encoding/binary"
	"testing"
)

// benchPopPush lays out a FUSE_WRITE of pages data pages as Linux does
// with INDIRECT_DESC — one indirect descriptor whose table holds the in
// header (40 B), write_in (40 B), one descriptor per 4 KiB page (scattered
// in guest memory, out of order), the out header (16 B) and write_out
// (8 B), both writable — then publishes, pops and pushes it back in a loop.
func benchPopPush(b *testing.B, pages int) {
	const Q = 1024
	g := newGuest(b)
	r := newRing(g, Q)
	r.indirect, r.eventIdx = true, true
	q := r.open(b)
	var table []desc
	table = append(table, desc{dataGPA, 40, descNext, 1}, desc{dataGPA + 0x40, 40, descNext, 2})
	for i := range pages {
		// A stride that visits the 512 page slots of 2 MiB out of order.
		slot := (i*167 + 11) % 512
		table = append(table, desc{dataGPA + 0x1000 + uint64(slot)*0x1000, 4096, descNext, uint16(len(table) + 1)})
	}
	table = append(table, desc{dataGPA + 0x80, 16, descWrite | descNext, uint16(len(table) + 1)}, desc{dataGPA + 0xa0, 8, descWrite, 0})
	g.writeTable(tablesGPA, table...)
	r.setDesc(0, desc{tablesGPA, uint32(16 * len(table)), descIndirect, 0})

	availRing := g.host(r.avail, 4+2*Q)
	availIdx := availRing[2:4]
	c := NewDescChain(Q)
	idx := uint16(0)
	b.SetBytes(int64(pages * 4096))
	b.ReportAllocs()
	for b.Loop() {
		binary.LittleEndian.PutUint16(availRing[4+2*int(idx%Q):], 0)
		idx++
		binary.LittleEndian.PutUint16(availIdx, idx)
		ok, err := q.Pop(c, g.mem)
		if !ok || err != nil {
			b.Fatal(ok, err)
		}
		q.Push(c.Token, 24)
	}
	b.StopTimer()
	if n := len(c.Readable.Segments()); n != pages+2 {
		b.Fatalf("%d readable segments, want %d", n, pages+2)
	}
	if n := len(c.Writable.Segments()); n != 2 {
		b.Fatalf("%d writable segments", n)
	}
}

// BenchmarkPopPush pops and pushes a 1 MiB FUSE_WRITE (256 data pages) on a
// ring of 1024, as a Kata guest sends it.
func BenchmarkPopPush(b *testing.B) { benchPopPush(b, 256) }

// BenchmarkPopPush4K pops and pushes a 4 KiB FUSE_WRITE.
func BenchmarkPopPush4K(b *testing.B) { benchPopPush(b, 1) }

// benchPackedPopPush is benchPopPush on a packed ring: the same indirect
// table, one slot per request, made available, popped and returned in a
// loop that laps the ring.
func benchPackedPopPush(b *testing.B, pages int) {
	const Q = 1024
	g := newGuest(b)
	r := newPring(g, Q)
	r.indirect, r.eventIdx = true, true
	q := r.open(b)
	var table []byte
	table = append(table, pdesc{dataGPA, 40, 0}.bytes(0, 0)...)
	table = append(table, pdesc{dataGPA + 0x40, 40, 0}.bytes(0, 0)...)
	for i := range pages {
		slot := (i*167 + 11) % 512
		table = append(table, pdesc{dataGPA + 0x1000 + uint64(slot)*0x1000, 4096, 0}.bytes(0, 0)...)
	}
	table = append(table, pdesc{dataGPA + 0x80, 16, descWrite}.bytes(0, descWrite)...)
	table = append(table, pdesc{dataGPA + 0xa0, 8, descWrite}.bytes(0, descWrite)...)
	g.write(tablesGPA, table)
	ring := g.host(ringDesc, descSize*Q)
	c := NewDescChain(Q)
	slot, wrap := 0, true
	b.SetBytes(int64(pages * 4096))
	b.ReportAllocs()
	for b.Loop() {
		copy(ring[slot*descSize:], pdesc{tablesGPA, uint32(len(table)), descIndirect}.bytes(uint16(slot), descIndirect|availFlags(wrap)))
		if slot++; slot == Q {
			slot, wrap = 0, !wrap
		}
		ok, err := q.Pop(c, g.mem)
		if !ok || err != nil {
			b.Fatal(ok, err)
		}
		q.Push(c.Token, 24)
	}
	b.StopTimer()
	if n := len(c.Readable.Segments()); n != pages+2 {
		b.Fatalf("%d readable segments, want %d", n, pages+2)
	}
}

// BenchmarkPackedPopPush is BenchmarkPopPush on a packed ring.
func BenchmarkPackedPopPush(b *testing.B) { benchPackedPopPush(b, 256) }

// BenchmarkPackedPopPush4K is BenchmarkPopPush4K on a packed ring.
func BenchmarkPackedPopPush4K(b *testing.B) { benchPackedPopPush(b, 1) }
