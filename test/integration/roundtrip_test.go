package integration

import (
	"bytes"
	"fmt"
	"sync"
	"syscall"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestRoundTrips writes files through FUSE, checks them on the host and
// reads them back, over a matrix of ring sizes, chain shapes and memory
// layouts; requests up to the largest a Linux guest sends (max_pages).
func TestRoundTrips(t *testing.T) {
	high := []vmm.RegionSpec{
		{GuestPhysAddr: 0, Size: 16 * vmm.MiB, File: 0},
		{GuestPhysAddr: 4 * vmm.GiB, Size: 16 * vmm.MiB, File: 1},
		// A region high in the guest-physical space (1 TiB + 64 GiB), as a
		// large guest's hot-plugged DIMM.
		{GuestPhysAddr: 1<<40 + 64*vmm.GiB, Size: 64 * vmm.MiB, File: 2},
	}
	cases := []struct {
		name      string
		size      uint16
		indirect  vmm.IndirectMode
		layout    []vmm.RegionSpec
		bufRegion int
	}{
		{"q128-indirect", 128, vmm.IndirectAuto, nil, 1},
		{"q128-direct", 128, vmm.IndirectNever, nil, 1},
		{"q1024-indirect", 1024, vmm.IndirectAuto, nil, 1},
		{"q1024-direct", 1024, vmm.IndirectNever, nil, 1},
		{"q256-shared-memfd", 256, vmm.IndirectAuto, vmm.SharedLayout(64*vmm.MiB, 64*vmm.MiB), 1},
		{"q256-shared-memfd-direct", 256, vmm.IndirectNever, vmm.SharedLayout(64*vmm.MiB, 64*vmm.MiB), 1},
		{"q128-high-region", 128, vmm.IndirectAuto, high, 2},
		{"q1024-high-region-direct", 1024, vmm.IndirectNever, high, 2},
		{"q128-rings-high-bufs-low", 128, vmm.IndirectAuto, high, 0},
		{"q128-bufs-anywhere", 128, vmm.IndirectAuto, nil, -1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			o := opts()
			o.QueueSize, o.Indirect, o.BufRegion = tc.size, tc.indirect, tc.bufRegion
			if tc.layout != nil {
				o.Layout = tc.layout
			}
			if tc.name == "q128-rings-high-bufs-low" {
				o.RingRegion = 2
			}
			dev := d.connect(o)
			c := newFS(t, dev, 1)
			init := c.mount()
			// Linux sends at most max_pages pages, and at most queue size - 4
			// of them (header, args, out header, out args).
			pages := min(int(init.MaxPages), int(tc.size)-4)
			if pages <= 0 {
				t.Fatalf("INIT max_pages %d", init.MaxPages)
			}
			for i, n := range []int{1, 4095, 4096, 4097, 3*4096 + 7, pages * 4096} {
				c.roundTrip(d, fmt.Sprintf("f%d", i), pattern(i, n))
			}
			// O_DIRECT-like user buffers: data not page aligned.
			node, fh := c.create(vmm.RootID, "unaligned", syscall.O_RDWR)
			data := pattern(99, 3*4096)
			in := vmm.BuildRequest(c.Header(vmm.OpWrite, node), len(data), vmm.ReadWriteIn(fh, 0, uint32(len(data)), 0))
			reply, err := dev.DoRequest(1, vmm.FuseRequest{In: in, InPages: data, OutArgs: 8, PageOffset: 512, Indirect: tc.indirect})
			if err != nil {
				t.Fatal(err)
			}
			if h, body, err := vmm.ParseReply(reply); err != nil || h.Error != 0 || le.Uint32(body) != uint32(len(data)) {
				t.Fatalf("unaligned WRITE: %+v %x %v", h, body, err)
			}
			if !bytes.Equal(d.hostFile("unaligned"), data) {
				t.Fatalf("unaligned WRITE: host file differs")
			}
			in = vmm.BuildRequest(c.Header(vmm.OpRead, node), 0, vmm.ReadWriteIn(fh, 0, uint32(len(data)), 0))
			reply, err = dev.DoRequest(1, vmm.FuseRequest{In: in, OutPages: len(data), PageOffset: 100, Indirect: tc.indirect})
			if err != nil {
				t.Fatal(err)
			}
			if h, body, err := vmm.ParseReply(reply); err != nil || h.Error != 0 || !bytes.Equal(body, data) {
				t.Fatalf("unaligned READ: %+v %v (%d bytes)", h, err, len(body))
			}
			// The hiprio ring: FORGET, returned with used len 0.
			if err := c.Forget(node, 1); err != nil {
				t.Fatalf("FORGET: %v", err)
			}
			c.check()
			noViolations(t, dev)
		})
	}
}

// TestMultiQueue serves requests on several request rings at once,
// including ring indices above 1, each ring with its own files.
func TestMultiQueue(t *testing.T) {
	d := startDaemon(t, "--queues", "4")
	o := opts()
	o.Queues = 5
	dev := d.connect(o)
	if dev.QueueNum != 5 {
		t.Errorf("GET_QUEUE_NUM = %d, want 5", dev.QueueNum)
	}
	newFS(t, dev, 1).mount()
	var wg sync.WaitGroup
	errs := make(chan error, 4*32)
	for ring := 1; ring <= 4; ring++ {
		wg.Go(func() {
			s := vmm.NewSession(dev, ring)
			for i := range 32 {
				name := fmt.Sprintf("r%d-%d", ring, i)
				data := pattern(ring*100+i, 1000+i*997)
				b, err := s.Call(vmm.OpCreate, vmm.RootID, createIn(syscall.O_RDWR, 0o100644, name), nil, vmm.FuseEntryOutSize+16)
				if err != nil {
					errs <- fmt.Errorf("ring %d CREATE %s: %w", ring, name, err)
					return
				}
				node, fh := le.Uint64(b), le.Uint64(b[vmm.FuseEntryOutSize:])
				if n, err := s.Write(node, fh, 0, data); err != nil || int(n) != len(data) {
					errs <- fmt.Errorf("ring %d WRITE %s: %d, %w", ring, name, n, err)
					return
				}
				got, err := s.Read(node, fh, 0, uint32(len(data)))
				if err != nil || !bytes.Equal(got, data) {
					errs <- fmt.Errorf("ring %d READ %s: %d bytes, %v", ring, name, len(got), err)
					return
				}
				if err := s.Release(node, fh, syscall.O_RDWR); err != nil {
					errs <- fmt.Errorf("ring %d RELEASE: %w", ring, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for ring := 1; ring <= 4; ring++ {
		for i := range 32 {
			name := fmt.Sprintf("r%d-%d", ring, i)
			if !bytes.Equal(d.hostFile(name), pattern(ring*100+i, 1000+i*997)) {
				t.Errorf("host file %s differs", name)
			}
		}
		if h := dev.Queue(ring).History(); len(h) < 32*4 {
			t.Errorf("ring %d completed %d requests", ring, len(h))
		}
	}
	// Pause and resume one high ring while the others are untouched.
	base, err := dev.StopQueue(4)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.RestartQueue(4, base, false); err != nil {
		t.Fatal(err)
	}
	newFS(t, dev, 4).roundTrip(d, "ring4-after-restart", pattern(5, 5000))
	newFS(t, dev, 3).check()
	noViolations(t, dev)
}

// TestMaxRingIndex configures the highest ring index the protocol can
// address (255) and serves a request on it.
func TestMaxRingIndex(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.Queues = 256
	o.Layout = vmm.SplitLayout(64*vmm.MiB, 128*vmm.MiB)
	o.BufRegion = -1
	dev := d.connect(o)
	newFS(t, dev, 1).mount()
	for _, ring := range []int{2, 17, 128, 254, 255} {
		newFS(t, dev, ring).roundTrip(d, fmt.Sprintf("ring%d", ring), pattern(ring, 4096+ring))
	}
	noViolations(t, dev)
}

// TestStraddlingBuffers: with GPA-contiguous regions, every part of a
// request (header, arguments, data, reply, and the indirect table itself)
// may cross a region boundary; the daemon must split, not refuse, them.
func TestStraddlingBuffers(t *testing.T) {
	const (
		base = 1 * vmm.GiB
		rs   = 8 * vmm.MiB // each contiguous region
	)
	for _, indirect := range []bool{true, false} {
		t.Run(fmt.Sprintf("indirect=%v", indirect), func(t *testing.T) {
			d := startDaemon(t)
			o := opts()
			o.Layout = append([]vmm.RegionSpec{{GuestPhysAddr: 0, Size: 4 * vmm.MiB, File: 9}},
				vmm.ContiguousLayout(base, rs, rs, rs, rs, rs)...)
			o.BufRegion = 1
			dev := d.connect(o)
			c := newFS(t, dev, 1)
			c.mount()
			q := dev.Queue(1)
			node, fh := c.create(vmm.RootID, "straddle", syscall.O_RDWR)

			// The boundaries between the contiguous regions.
			b1, b2, b3, b4 := uint64(base+rs), uint64(base+2*rs), uint64(base+3*rs), uint64(base+4*rs)
			var allocs []uint64
			alloc := func(at uint64, n int) uint64 {
				t.Helper()
				if err := dev.Mem.AllocAt(at, uint64(n)); err != nil {
					t.Fatal(err)
				}
				allocs = append(allocs, at)
				return at
			}
			release := func() {
				for _, a := range allocs {
					dev.Mem.Free(a)
				}
				allocs = nil
			}
			data := pattern(42, 3*4096+123)
			in := vmm.BuildRequest(c.Header(vmm.OpWrite, node), len(data), vmm.ReadWriteIn(fh, 0, uint32(len(data)), 0))
			hdr := alloc(b1-20, vmm.FuseInHeaderSize)          // header crosses b1
			args := alloc(b1+64, len(in)-vmm.FuseInHeaderSize) // args next to it
			dat := alloc(b2-5000, len(data))                   // data crosses b2
			out := alloc(b3-10, vmm.FuseOutHeaderSize+8)       // reply crosses b3
			for _, w := range []struct {
				b  []byte
				at uint64
			}{{in[:vmm.FuseInHeaderSize], hdr}, {in[vmm.FuseInHeaderSize:], args}, {data, dat}} {
				if err := dev.Mem.WriteAt(w.b, w.at); err != nil {
					t.Fatal(err)
				}
			}
			segs := []vmm.Segment{
				{Addr: hdr, Len: vmm.FuseInHeaderSize},
				{Addr: args, Len: uint32(len(in) - vmm.FuseInHeaderSize)},
				{Addr: dat, Len: uint32(len(data))},
				{Addr: out, Len: vmm.FuseOutHeaderSize + 8, Write: true},
			}
			if indirect {
				// The table crosses b4 (4 entries, 2 on each side).
				alloc(b4-2*vmm.DescSize, len(segs)*vmm.DescSize)
			}
			ch := submitStraddling(t, q, segs, indirect, b4-2*vmm.DescSize)
			n, err := ch.Wait(opTimeout)
			if err != nil {
				t.Fatal(err)
			}
			reply := make([]byte, n)
			dev.Mem.ReadAt(reply, out)
			if h, body, err := vmm.ParseReply(reply); err != nil || h.Error != 0 || le.Uint32(body) != uint32(len(data)) {
				t.Fatalf("straddling WRITE: %+v %x %v", h, body, err)
			}
			if got := d.hostFile("straddle"); !bytes.Equal(got, data) {
				t.Fatalf("straddling WRITE: host file differs at %d", firstDiff(got, data))
			}
			release()

			// READ into one reply segment that runs from the first
			// contiguous region through the second into the third.
			big := rs + 2*4096
			whole := pattern(7, big)
			d.writeHostFile("big", whole)
			bnode := c.lookup(vmm.RootID, "big").NodeID
			bfh := c.open(bnode, syscall.O_RDONLY)
			rin := vmm.BuildRequest(c.Header(vmm.OpRead, bnode), 0, vmm.ReadWriteIn(bfh, 0, uint32(big), 0))
			rhdr := alloc(b3-30, len(rin))                   // crosses b3
			rout1 := alloc(b3+4096-8, vmm.FuseOutHeaderSize) // out header in the last region
			rout := alloc(b1-4096, big)                      // crosses b1 and b2
			dev.Mem.WriteAt(rin, rhdr)
			segs = []vmm.Segment{
				{Addr: rhdr, Len: uint32(len(rin))},
				{Addr: rout1, Len: vmm.FuseOutHeaderSize, Write: true},
				{Addr: rout, Len: uint32(big), Write: true},
			}
			if indirect {
				alloc(b3+2*4096-vmm.DescSize, len(segs)*vmm.DescSize) // in one region
			}
			ch = submitStraddling(t, q, segs, indirect, b3+2*4096-vmm.DescSize)
			if n, err = ch.Wait(opTimeout); err != nil {
				t.Fatal(err)
			}
			if n != uint32(vmm.FuseOutHeaderSize+big) {
				t.Fatalf("straddling READ: used len %d, want %d", n, vmm.FuseOutHeaderSize+big)
			}
			hb := make([]byte, vmm.FuseOutHeaderSize)
			dev.Mem.ReadAt(hb, rout1)
			if le.Uint32(hb) != uint32(n) || le.Uint32(hb[4:]) != 0 {
				t.Fatalf("straddling READ: out header %x", hb)
			}
			got := make([]byte, big)
			dev.Mem.ReadAt(got, rout)
			if !bytes.Equal(got, whole) {
				t.Fatalf("straddling READ: data differs at %d", firstDiff(got, whole))
			}
			release()
			c.check()
			noViolations(t, dev)
		})
	}
}

// submitStraddling publishes segs as a direct chain, or as an indirect
// table at tableAt (already allocated; it may cross a region boundary), and
// kicks.
func submitStraddling(t *testing.T, q *vmm.Queue, segs []vmm.Segment, indirect bool, tableAt uint64) *vmm.Chain {
	t.Helper()
	if !indirect {
		ch, err := q.Submit(segs, vmm.IndirectNever)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}
	if q.Packed() {
		return submitStraddlingPacked(t, q, segs, tableAt)
	}
	ds := make([]vmm.Desc, len(segs))
	for i, s := range segs {
		ds[i] = vmm.Desc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags |= vmm.DescWrite
		}
		if i+1 < len(segs) {
			ds[i].Flags |= vmm.DescNext
			ds[i].Next = uint16(i + 1)
		}
	}
	if err := q.WriteTable(tableAt, ds); err != nil {
		t.Fatal(err)
	}
	ids, err := q.AllocDescs(1)
	if err != nil {
		t.Fatal(err)
	}
	q.WriteDesc(ids[0], vmm.Desc{Addr: tableAt, Len: uint32(len(ds)) * vmm.DescSize, Flags: vmm.DescIndirect})
	ch := q.AddRaw(ids[0], ids, 0)
	if _, err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	return ch
}

// submitStraddlingPacked is submitStraddling's indirect chain on a packed
// ring: the table holds packed descriptors (no NEXT), under a buffer id
// beyond the ring's size (the spec bounds none; the driver's own ids are
// below it).
func submitStraddlingPacked(t *testing.T, q *vmm.Queue, segs []vmm.Segment, tableAt uint64) *vmm.Chain {
	t.Helper()
	ds := make([]vmm.PackedDesc, len(segs))
	for i, s := range segs {
		ds[i] = vmm.PackedDesc{Addr: s.Addr, Len: s.Len}
		if s.Write {
			ds[i].Flags |= vmm.DescWrite
		}
	}
	if err := q.WritePackedTable(tableAt, ds); err != nil {
		t.Fatal(err)
	}
	const id = 0xfff0
	ch, err := q.AddPackedRaw([]vmm.PackedDesc{{Addr: tableAt, Len: uint32(len(ds)) * vmm.DescSize, ID: id, Flags: vmm.DescIndirect}}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	return ch
}
