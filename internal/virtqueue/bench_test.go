package virtqueue

import (
	"encoding/binary"
	"testing"
)

// benchQ is the benchmarks' ring size, a Kata guest's.
const benchQ = 1024

// benchTable returns the indirect table of a FUSE_WRITE of pages data pages
// as Linux lays it out with INDIRECT_DESC: the in header (40 B), write_in
// (40 B), one descriptor per 4 KiB page (scattered in guest memory, out of
// order), the out header (16 B) and write_out (8 B), both writable. Only
// WRITE is set; each layout adds its own chaining.
func benchTable(pages int) []pdesc {
	t := []pdesc{{dataGPA, 40, 0}, {dataGPA + 0x40, 40, 0}}
	for i := range pages {
		// A stride that visits the 512 page slots of 2 MiB out of order.
		slot := (i*167 + 11) % 512
		t = append(t, pdesc{dataGPA + 0x1000 + uint64(slot)*0x1000, 4096, 0})
	}
	return append(t, pdesc{dataGPA + 0x80, 16, descWrite}, pdesc{dataGPA + 0xa0, 8, descWrite})
}

// benchSplit lays out a split ring holding the request of benchTable at
// descriptor 0 and returns the ring's Config with a function that publishes
// that request once more.
func benchSplit(g *guest, pages int) (Config, func()) {
	r := newRing(g, benchQ)
	var table []desc
	for i, d := range benchTable(pages) {
		table = append(table, desc{d.addr, d.len, d.flags | descNext, uint16(i + 1)})
	}
	table[len(table)-1].flags, table[len(table)-1].next = descWrite, 0
	g.writeTable(tablesGPA, table...)
	r.setDesc(0, desc{tablesGPA, uint32(descSize * len(table)), descIndirect, 0})
	availRing := g.host(r.avail, 4+2*benchQ)
	idx := uint16(0)
	return r.config(), func() {
		binary.LittleEndian.PutUint16(availRing[4+2*int(idx%benchQ):], 0)
		idx++
		binary.LittleEndian.PutUint16(availRing[2:4], idx)
	}
}

// benchPacked is benchSplit on a packed ring: the same indirect table, one
// slot per request, made available in a loop that laps the ring.
func benchPacked(g *guest, pages int) (Config, func()) {
	r := newPring(g, benchQ)
	var table []byte
	for _, d := range benchTable(pages) {
		table = append(table, d.bytes(0, d.flags)...)
	}
	g.write(tablesGPA, table)
	ring := g.host(ringDesc, descSize*benchQ)
	slot, wrap := 0, true
	return r.config(), func() {
		copy(ring[slot*descSize:], pdesc{tablesGPA, uint32(len(table)), descIndirect}.bytes(uint16(slot), descIndirect|availFlags(wrap)))
		if slot++; slot == benchQ {
			slot, wrap = 0, !wrap
		}
	}
}

// benchRequests publishes the request of pages data pages and takes it
// back with serve, in a loop.
func benchRequests(b *testing.B, packed bool, pages int, serve func(b *testing.B, q *Queue, c *DescChain, mem *GuestMemory)) {
	g := newGuest(b)
	open := benchSplit
	if packed {
		open = benchPacked
	}
	cfg, publish := open(g, pages)
	cfg.Indirect, cfg.EventIdx = true, true
	q := openQueue(b, cfg, g.mem)
	c := NewDescChain(benchQ)
	b.SetBytes(int64(pages * 4096))
	b.ReportAllocs()
	for b.Loop() {
		publish()
		serve(b, q, c, g.mem)
	}
	b.StopTimer()
	if n := len(c.Readable.Segments()); n != pages+2 {
		b.Fatalf("%d readable segments, want %d", n, pages+2)
	}
	if n := len(c.Writable.Segments()); n != 2 {
		b.Fatalf("%d writable segments", n)
	}
}

// popPush pops the request and pushes its reply.
func popPush(b *testing.B, q *Queue, c *DescChain, mem *GuestMemory) {
	ok, err := q.Pop(c, mem)
	if !ok || err != nil {
		b.Fatal(ok, err)
	}
	q.Push(c.Token, 24)
}

// runnerCycle is what internal/vhostuser's runner asks of a ring for one
// request when it serves them one at a time: look, pop what was seen,
// push the reply, notify once no more chains wait than replies were
// pushed, look again and, finding nothing, enable kicks before sleeping.
func runnerCycle(b *testing.B, q *Queue, c *DescChain, mem *GuestMemory) {
	if !q.Seen() {
		if pending, err := q.Snapshot(); !pending || err != nil {
			b.Fatal(pending, err)
		}
	}
	if ok, err := q.PopSeen(c, mem); !ok || err != nil {
		b.Fatal(ok, err)
	}
	q.LogWritten(c, 24)
	q.Push(c.Token, 24)
	if q.Waiting(2) <= 1 {
		if err := q.Notify(); err != nil {
			b.Fatal(err)
		}
	}
	if q.Seen() {
		b.Fatal("a chain seen after the only one")
	}
	if pending, err := q.Snapshot(); pending || err != nil || q.EnableNotify() {
		b.Fatal("a chain after the only one", pending, err)
	}
}

// BenchmarkPopPush pops and pushes a 1 MiB FUSE_WRITE (256 data pages) on a
// ring of 1024, as a Kata guest sends it.
func BenchmarkPopPush(b *testing.B) { benchRequests(b, false, 256, popPush) }

// BenchmarkPopPush4K pops and pushes a 4 KiB FUSE_WRITE.
func BenchmarkPopPush4K(b *testing.B) { benchRequests(b, false, 1, popPush) }

// BenchmarkPackedPopPush is BenchmarkPopPush on a packed ring.
func BenchmarkPackedPopPush(b *testing.B) { benchRequests(b, true, 256, popPush) }

// BenchmarkPackedPopPush4K is BenchmarkPopPush4K on a packed ring.
func BenchmarkPackedPopPush4K(b *testing.B) { benchRequests(b, true, 1, popPush) }

// BenchmarkRunnerCycle4K is a 4 KiB FUSE_WRITE taken through every Queue
// call the runner makes for it.
func BenchmarkRunnerCycle4K(b *testing.B) { benchRequests(b, false, 1, runnerCycle) }

// BenchmarkPackedRunnerCycle4K is BenchmarkRunnerCycle4K on a packed ring.
func BenchmarkPackedRunnerCycle4K(b *testing.B) { benchRequests(b, true, 1, runnerCycle) }
