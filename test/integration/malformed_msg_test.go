package integration

import (
	"fmt"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// startAckAll starts a daemon and a QEMU-like device on which every
// message is acknowledged, mounts the session, and returns them.
func startAckAll(t *testing.T, o vmm.Options) (*daemon, *vmm.Device, *fsc) {
	t.Helper()
	d := startDaemon(t)
	o.Ack = vmm.AckAll
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	return d, dev, c
}

// stillWorks checks the connection is in step, ring 1 serves, and a
// pause/resume of ring 1 works.
func stillWorks(t *testing.T, dev *vmm.Device, c *fsc) {
	t.Helper()
	connAlive(t, dev)
	c.check()
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatalf("stop: %v", err)
	}
	if err := dev.RestartQueue(1, base, false); err != nil {
		t.Fatalf("restart: %v", err)
	}
	c.check()
}

// TestTruncatedPayloads sends every typed message with payloads cut short:
// each is refused (REPLY_ACK failure, or for messages with a reply of their
// own, an answer that changes nothing), fds attached are closed, and the
// connection goes on.
func TestTruncatedPayloads(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	ev, mfd := eventfd(t), memfd(t, 4096)
	r0, r1 := dev.Mem.Regions()[0], dev.Mem.Regions()[1]
	addr, err := dev.Queue(1).VringAddr()
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		req  vmm.Request
		full []byte
		fds  []int
		cuts []int
	}{
		{vmm.SetFeatures, vmm.U64(dev.Features), nil, []int{0, 4, 7}},
		{vmm.SetProtocolFeatures, vmm.U64(dev.ProtocolFeatures), nil, []int{0, 7}},
		{vmm.SetStatus, vmm.U64(vmm.StatusFeaturesOK), nil, []int{0, 1, 7}},
		{vmm.SetVringNum, vmm.VringState{Index: 1, Num: 128}.Bytes(), nil, []int{0, 4, 7}},
		{vmm.SetVringBase, vmm.VringState{Index: 1, Num: 0}.Bytes(), nil, []int{0, 4, 7}},
		{vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 0}.Bytes(), nil, []int{0, 4, 7}},
		{vmm.SetVringAddr, addr.Bytes(), nil, []int{0, 8, 32, 39}},
		{vmm.SetVringKick, vmm.VringFile(1, false), []int{ev}, []int{0, 4, 7}},
		{vmm.SetVringCall, vmm.VringFile(1, false), []int{ev}, []int{0, 4, 7}},
		{vmm.SetVringErr, vmm.VringFile(1, false), []int{ev}, []int{0, 7}},
		{vmm.SetMemTable, vmm.MemTableBytes([]vmm.MemRegion{r0.MemRegion(), r1.MemRegion()}), []int{r0.Fd(), r1.Fd()},
			[]int{0, 4, 7, 8, 8 + 32, 8 + 64 - 1}},
		{vmm.AddMemReg, vmm.SingleRegionBytes(vmm.MemRegion{GuestPhysAddr: 16 * vmm.GiB, MemorySize: 4096, UserAddr: 0x10000}), []int{mfd},
			[]int{0, 8, 39}},
		{vmm.RemMemReg, vmm.SingleRegionBytes(r1.MemRegion()), []int{r1.Fd()}, []int{0, 8, 39}},
		{vmm.SetInflightFd, vmm.Inflight{MmapSize: 4096, NumQueues: 2, QueueSize: 128}.Bytes(), []int{mfd}, []int{0, 19}},
		{vmm.SetConfig, vmm.ConfigMsg{Size: 4, Payload: []byte("abcd")}.Bytes(), nil, []int{0, 11, 15}},
		{vmm.SetBackendReqFd, nil, nil, []int{0}}, // no fd: refused
		{vmm.SetLogFd, nil, nil, []int{0}},
	}
	before := d.fdCount()
	for _, tc := range cases {
		for _, cut := range tc.cuts {
			what := fmt.Sprintf("%v with %d of %d payload bytes", tc.req, cut, len(tc.full))
			mustRefuse(t, dev, what, tc.req, tc.full[:cut], tc.fds...)
			connAlive(t, dev)
		}
	}
	// Messages with a reply of their own are answered anyway; a truncated
	// GET_VRING_BASE must not stop the ring.
	for _, cut := range []int{0, 4, 7} {
		m, err := dev.Conn.CallFlags(vmm.GetVringBase, vmm.VringState{Index: 1}.Bytes()[:cut], nil, false)
		if err != nil {
			t.Fatalf("GET_VRING_BASE with %d payload bytes: %v", cut, err)
		}
		m.CloseFds()
		c.check()
	}
	for _, p := range [][]byte{nil, make([]byte, 11), vmm.ConfigMsg{Size: 40}.Bytes(), vmm.ConfigMsg{Size: 4, Payload: make([]byte, 8)}.Bytes(),
		vmm.ConfigMsg{Size: 1 << 20}.Bytes()} {
		m, err := dev.Conn.CallFlags(vmm.GetConfig, p, nil, false)
		if err != nil {
			t.Fatalf("GET_CONFIG with a %d-byte payload: %v", len(p), err)
		}
		m.CloseFds()
	}
	// SET_LOG_BASE, truncated, with its fd.
	for _, cut := range []int{0, 8} {
		mustRefuse(t, dev, "SET_LOG_BASE truncated", vmm.SetLogBase, le64(le64(nil, 4096), 0)[:cut], mfd)
	}
	stillWorks(t, dev, c)
	if after := d.fdCount(); after > before+2 {
		t.Errorf("daemon fds grew from %d to %d: fds of refused messages leak", before, after)
	}
	c.roundTrip(d, "after", pattern(1, 30000))
	noViolations(t, dev)
}

// TestWrongFdCounts: messages carrying fewer (or more) fds than they need
// are refused without side effects.
func TestWrongFdCounts(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	r0, r1 := dev.Mem.Regions()[0], dev.Mem.Regions()[1]
	regs := []vmm.MemRegion{r0.MemRegion(), r1.MemRegion()}
	mustRefuse(t, dev, "SET_MEM_TABLE 2 regions 1 fd", vmm.SetMemTable, vmm.MemTableBytes(regs), r0.Fd())
	mustRefuse(t, dev, "SET_MEM_TABLE 2 regions no fd", vmm.SetMemTable, vmm.MemTableBytes(regs))
	mustRefuse(t, dev, "SET_MEM_TABLE 1 region 2 fds", vmm.SetMemTable, vmm.MemTableBytes(regs[:1]), r0.Fd(), r1.Fd())
	c.roundTrip(d, "old-table", pattern(1, 10000)) // the old table is intact
	mustRefuse(t, dev, "ADD_MEM_REG without fd", vmm.AddMemReg,
		vmm.SingleRegionBytes(vmm.MemRegion{GuestPhysAddr: 16 * vmm.GiB, MemorySize: 4096, UserAddr: 0x10000}))
	// CALL without fd and without NOFD: refused, the old call fd stays.
	mustRefuse(t, dev, "SET_VRING_CALL without fd", vmm.SetVringCall, vmm.VringFile(1, false))
	c.check()
	// KICK without fd and without NOFD on a stopped ring: refused, the ring
	// is not started; a proper KICK then starts it.
	q := dev.Queue(1)
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := q.VringAddr()
	mustAccept(t, dev, "SET_VRING_NUM", vmm.SetVringNum, vmm.VringState{Index: 1, Num: uint32(q.Size())}.Bytes())
	mustAccept(t, dev, "SET_VRING_BASE", vmm.SetVringBase, vmm.VringState{Index: 1, Num: base}.Bytes())
	mustAccept(t, dev, "SET_VRING_ADDR", vmm.SetVringAddr, a.Bytes())
	mustRefuse(t, dev, "SET_VRING_KICK without fd", vmm.SetVringKick, vmm.VringFile(1, false))
	mustAccept(t, dev, "SET_VRING_ENABLE", vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 1}.Bytes())
	fc, err := q.SubmitFuse(getattrRequest(c, vmm.IndirectAuto))
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Kick(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-fc.Done():
		t.Fatalf("a ring whose KICK was refused served a request")
	case <-time.After(300 * time.Millisecond):
	}
	kick, err := q.NewKickFd()
	if err != nil {
		t.Fatal(err)
	}
	mustAccept(t, dev, "SET_VRING_KICK", vmm.SetVringKick, vmm.VringFile(1, false), kick)
	if b, err := fc.Wait(opTimeout); err != nil {
		t.Fatalf("the request waiting on the ring: %v", err)
	} else if h, _, err := vmm.ParseReply(b); err != nil || h.Error != 0 {
		t.Fatalf("the request waiting on the ring: %+v %v", h, err)
	}
	stillWorks(t, dev, c)
	noViolations(t, dev)
}

// TestBadRingIndex: ring indices beyond 255 are refused; GET_VRING_BASE of
// one still gets an answer.
func TestBadRingIndex(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	a, _ := dev.Queue(1).VringAddr()
	for _, idx := range []uint32{256, 257, 1000, 1 << 16, 0xffffffff} {
		mustRefuse(t, dev, fmt.Sprintf("SET_VRING_NUM ring %d", idx), vmm.SetVringNum, vmm.VringState{Index: idx, Num: 128}.Bytes())
		mustRefuse(t, dev, fmt.Sprintf("SET_VRING_BASE ring %d", idx), vmm.SetVringBase, vmm.VringState{Index: idx}.Bytes())
		mustRefuse(t, dev, fmt.Sprintf("SET_VRING_ENABLE ring %d", idx), vmm.SetVringEnable, vmm.VringState{Index: idx, Num: 1}.Bytes())
		a.Index = idx
		mustRefuse(t, dev, fmt.Sprintf("SET_VRING_ADDR ring %d", idx), vmm.SetVringAddr, a.Bytes())
		m, err := dev.Conn.CallFlags(vmm.GetVringBase, vmm.VringState{Index: idx}.Bytes(), nil, false)
		if err != nil {
			t.Fatalf("GET_VRING_BASE ring %d: %v", idx, err)
		}
		m.CloseFds()
	}
	// An out-of-range enable value.
	mustRefuse(t, dev, "SET_VRING_ENABLE 2", vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 2}.Bytes())
	// SET_VRING_BASE beyond 16 bits.
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, dev, "SET_VRING_BASE 65536", vmm.SetVringBase, vmm.VringState{Index: 1, Num: 1 << 16}.Bytes())
	if err := dev.RestartQueue(1, base, false); err != nil {
		t.Fatal(err)
	}
	stillWorks(t, dev, c)
	c.roundTrip(d, "after", pattern(2, 2000))
	noViolations(t, dev)
}

// TestBadRingSize: SET_VRING_NUM must be a power of two in 1..32768, and
// cannot change a running ring.
func TestBadRingSize(t *testing.T) {
	_, dev, c := startAckAll(t, opts())
	mustRefuse(t, dev, "SET_VRING_NUM on a running ring", vmm.SetVringNum, vmm.VringState{Index: 1, Num: 256}.Bytes())
	mustRefuse(t, dev, "SET_VRING_BASE on a running ring", vmm.SetVringBase, vmm.VringState{Index: 1, Num: 5}.Bytes())
	// A running ring's addresses stay; only its log flag may change (QEMU
	// sends them again with VHOST_VRING_F_LOG when a migration starts).
	a, _ := dev.Queue(1).VringAddr()
	mustAccept(t, dev, "SET_VRING_ADDR on a running ring, same addresses", vmm.SetVringAddr, a.Bytes())
	moved := a
	moved.Used += 4096
	mustRefuse(t, dev, "SET_VRING_ADDR moving a running ring", vmm.SetVringAddr, moved.Bytes())
	unknown := a
	unknown.Flags = 2
	mustRefuse(t, dev, "SET_VRING_ADDR with unknown flags", vmm.SetVringAddr, unknown.Bytes())
	c.check()
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []uint32{0, 3, 100, 129, 32767, 32769, 65536, 1 << 31, 0xffffffff} {
		mustRefuse(t, dev, fmt.Sprintf("SET_VRING_NUM %d", n), vmm.SetVringNum, vmm.VringState{Index: 1, Num: n}.Bytes())
	}
	for _, n := range []uint32{1, 2, 32768} {
		mustAccept(t, dev, fmt.Sprintf("SET_VRING_NUM %d", n), vmm.SetVringNum, vmm.VringState{Index: 1, Num: n}.Bytes())
	}
	if err := dev.RestartQueue(1, base, false); err != nil { // sends the real size again
		t.Fatal(err)
	}
	stillWorks(t, dev, c)
	noViolations(t, dev)
}

// TestLargestRing serves a ring of 32768 descriptors.
func TestLargestRing(t *testing.T) {
	d := startDaemon(t)
	o := opts()
	o.QueueSize = 32768
	dev := d.connect(o)
	c := newFS(t, dev, 1)
	c.mount()
	c.roundTrip(d, "big-ring", pattern(1, 1<<20))
	noViolations(t, dev)
}

// TestRingAddrOutsideMemory: SET_VRING_ADDR naming addresses the memory
// table does not cover makes the following KICK fail: the ring is not
// started and serves nothing; a correct ADDR and KICK then start it.
func TestRingAddrOutsideMemory(t *testing.T) {
	const notMapped = 0x1234_0000_0000
	for _, tc := range []struct {
		name string
		bad  func(a vmm.VringAddr, q *vmm.Queue, dev *vmm.Device) vmm.VringAddr
	}{
		{"desc-unmapped", func(a vmm.VringAddr, _ *vmm.Queue, _ *vmm.Device) vmm.VringAddr { a.Desc = notMapped; return a }},
		{"avail-unmapped", func(a vmm.VringAddr, _ *vmm.Queue, _ *vmm.Device) vmm.VringAddr { a.Avail = notMapped; return a }},
		{"used-unmapped", func(a vmm.VringAddr, _ *vmm.Queue, _ *vmm.Device) vmm.VringAddr { a.Used = notMapped; return a }},
		{"gpa-instead-of-hva", func(a vmm.VringAddr, q *vmm.Queue, _ *vmm.Device) vmm.VringAddr {
			r := q.Addrs()
			a.Desc, a.Avail, a.Used = r.Desc, r.Avail, r.Used
			return a
		}},
		{"used-crosses-region-end", func(a vmm.VringAddr, _ *vmm.Queue, dev *vmm.Device) vmm.VringAddr {
			r := dev.Mem.Regions()[0]
			a.Used = r.UserAddr + r.Size - 64
			return a
		}},
		{"desc-misaligned", func(a vmm.VringAddr, _ *vmm.Queue, _ *vmm.Device) vmm.VringAddr { a.Desc += 8; return a }},
		{"used-wraps", func(a vmm.VringAddr, _ *vmm.Queue, _ *vmm.Device) vmm.VringAddr { a.Used = ^uint64(0) - 15; return a }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, dev, c := startAckAll(t, opts())
			q := dev.Queue(1)
			base, err := dev.StopQueue(1)
			if err != nil {
				t.Fatal(err)
			}
			good, _ := q.VringAddr()
			mustAccept(t, dev, "SET_VRING_NUM", vmm.SetVringNum, vmm.VringState{Index: 1, Num: uint32(q.Size())}.Bytes())
			mustAccept(t, dev, "SET_VRING_BASE", vmm.SetVringBase, vmm.VringState{Index: 1, Num: base}.Bytes())
			dev.Conn.CallFlags(vmm.SetVringAddr, tc.bad(good, q, dev).Bytes(), nil, true) // may be refused here already
			kick, err := q.NewKickFd()
			if err != nil {
				t.Fatal(err)
			}
			mustRefuse(t, dev, "SET_VRING_KICK after a bad SET_VRING_ADDR", vmm.SetVringKick, vmm.VringFile(1, false), kick)
			mustAccept(t, dev, "SET_VRING_ENABLE", vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 1}.Bytes())
			fd, _ := q.NewCallFd()
			mustAccept(t, dev, "SET_VRING_CALL", vmm.SetVringCall, vmm.VringFile(1, false), fd)
			fc, err := q.SubmitFuse(getattrRequest(c, vmm.IndirectAuto))
			if err != nil {
				t.Fatal(err)
			}
			q.Kick()
			select {
			case <-fc.Done():
				t.Fatalf("a ring with bad addresses served a request")
			case <-time.After(300 * time.Millisecond):
			}
			// GET_VRING_BASE of the ring that never started.
			if b, err := dev.Conn.GetVringBase(1); err != nil || b != base {
				t.Errorf("GET_VRING_BASE of the unstarted ring: %d, %v; want %d", b, err, base)
			}
			if err := dev.RestartQueue(1, base, false); err != nil {
				t.Fatalf("restart with good addresses: %v", err)
			}
			if b, err := fc.Wait(opTimeout); err != nil {
				t.Fatalf("the waiting request: %v", err)
			} else if h, _, err := vmm.ParseReply(b); err != nil || h.Error != 0 {
				t.Fatalf("the waiting request: %+v %v", h, err)
			}
			stillWorks(t, dev, c)
			noViolations(t, dev)
		})
	}
}

// TestBadRegions: regions beyond their file (no SIGBUS later), of size 0,
// wrapping, overlapping in guest-physical or front-end address space, and
// removal of regions that do not exist are all refused; the memory table
// in use stays intact.
func TestBadRegions(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	small := memfd(t, 1*vmm.MiB)
	r0, r1 := dev.Mem.Regions()[0].MemRegion(), dev.Mem.Regions()[1].MemRegion()
	fd0, fd1 := dev.Mem.Regions()[0].Fd(), dev.Mem.Regions()[1].Fd()
	const gpa, uva = 16 * vmm.GiB, 0x5000_0000_0000
	reg := func(g, size, u, off uint64) []byte {
		return vmm.SingleRegionBytes(vmm.MemRegion{GuestPhysAddr: g, MemorySize: size, UserAddr: u, MmapOffset: off})
	}
	bad := []struct {
		what string
		p    []byte
		fd   int
	}{
		{"size beyond the file", reg(gpa, 2*vmm.MiB, uva, 0), small},
		{"offset+size beyond the file", reg(gpa, 1*vmm.MiB, uva, 4096), small},
		{"offset beyond the file", reg(gpa, 4096, uva, 2*vmm.MiB), small},
		{"offset+size overflows", reg(gpa, 4096, uva, ^uint64(0)-100), small},
		{"size 0", reg(gpa, 0, uva, 0), small},
		{"gpa wraps", reg(^uint64(0)-4095, 8192, uva, 0), small},
		{"uva wraps", reg(gpa, 8192, ^uint64(0)-4095, 0), small},
		{"gpa overlaps region 1", reg(r1.GuestPhysAddr+vmm.MiB, vmm.MiB, uva, 0), small},
		{"gpa contains region 0", reg(0, 1*vmm.MiB, uva, 0), small},
		{"uva overlaps region 0", reg(gpa, vmm.MiB, r0.UserAddr+4096, 0), small},
		{"not a memory fd", reg(gpa, 4096, uva, 0), eventfd(t)},
	}
	for _, b := range bad {
		mustRefuse(t, dev, "ADD_MEM_REG "+b.what, vmm.AddMemReg, b.p, b.fd)
		c.check()
	}
	// The same as a whole table (replacing the good one).
	for _, b := range bad {
		var r vmm.MemRegion
		p := b.p[8:]
		r.GuestPhysAddr, r.MemorySize, r.UserAddr, r.MmapOffset = le.Uint64(p), le.Uint64(p[8:]), le.Uint64(p[16:]), le.Uint64(p[24:])
		mustRefuse(t, dev, "SET_MEM_TABLE with "+b.what, vmm.SetMemTable, vmm.MemTableBytes([]vmm.MemRegion{r0, r1, r}), fd0, fd1, b.fd)
	}
	mustRefuse(t, dev, "SET_MEM_TABLE with overlapping regions", vmm.SetMemTable,
		vmm.MemTableBytes([]vmm.MemRegion{r0, r1, {GuestPhysAddr: r0.GuestPhysAddr + 4096, MemorySize: 4096, UserAddr: uva}}), fd0, fd1, small)
	mustRefuse(t, dev, "SET_MEM_TABLE with 0 regions", vmm.SetMemTable, vmm.MemTableBytes(nil))
	mustRefuse(t, dev, "SET_MEM_TABLE with 9 regions", vmm.SetMemTable, vmm.MemTableBytes(make([]vmm.MemRegion, 9)), fd0, fd0, fd0, fd0, fd0, fd0, fd0, fd0)
	// REM_MEM_REG of regions that do not exist: other size, other guest
	// address, other user address.
	for _, r := range []vmm.MemRegion{
		{GuestPhysAddr: gpa, MemorySize: vmm.MiB, UserAddr: uva},
		{GuestPhysAddr: r1.GuestPhysAddr, MemorySize: r1.MemorySize / 2, UserAddr: r1.UserAddr},
		{GuestPhysAddr: r1.GuestPhysAddr + 4096, MemorySize: r1.MemorySize, UserAddr: r1.UserAddr},
		{GuestPhysAddr: r1.GuestPhysAddr, MemorySize: r1.MemorySize, UserAddr: r1.UserAddr + 4096},
	} {
		mustRefuse(t, dev, fmt.Sprintf("REM_MEM_REG %+v", r), vmm.RemMemReg, vmm.SingleRegionBytes(r), fd1)
	}
	// A good region in the small file, added twice (QEMU may resend),
	// used, and removed by guest address, size and user address (not the
	// mmap offset).
	ok := vmm.MemRegion{GuestPhysAddr: gpa, MemorySize: vmm.MiB, UserAddr: uva}
	mustAccept(t, dev, "ADD_MEM_REG good", vmm.AddMemReg, vmm.SingleRegionBytes(ok), small)
	mustAccept(t, dev, "ADD_MEM_REG again", vmm.AddMemReg, vmm.SingleRegionBytes(ok), small)
	other := ok
	other.MmapOffset = 8192
	mustAccept(t, dev, "REM_MEM_REG matching but for mmap_offset", vmm.RemMemReg, vmm.SingleRegionBytes(other), small)
	mustRefuse(t, dev, "REM_MEM_REG twice", vmm.RemMemReg, vmm.SingleRegionBytes(ok), small)
	stillWorks(t, dev, c)
	c.roundTrip(d, "after", pattern(3, 100000))
	d.alive()
	noViolations(t, dev)
}

// TestSplitMessages: a message may arrive in pieces, with its fds on a
// later piece than the header; the daemon reassembles it.
func TestSplitMessages(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	small := memfd(t, vmm.MiB)
	r := vmm.MemRegion{GuestPhysAddr: 16 * vmm.GiB, MemorySize: vmm.MiB, UserAddr: 0x5000_0000_0000}
	p := vmm.SingleRegionBytes(r)
	h := vmm.Header{Request: vmm.AddMemReg, Flags: vmm.FlagVersion | vmm.FlagNeedReply, Size: uint32(len(p))}.Bytes()
	cn := dev.Conn
	for _, split := range []int{1, 6, 11, 12, 13, 20, 51} {
		msg := append(append([]byte(nil), h...), p...)
		if err := cn.SendBytes(msg[:split], nil); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		if err := cn.SendBytes(msg[split:], []int{small}); err != nil {
			t.Fatal(err)
		}
		m, err := cn.Recv()
		if err != nil {
			t.Fatalf("split at %d: %v", split, err)
		}
		if v, err := m.U64(); err != nil || v != 0 || m.Request != vmm.AddMemReg {
			t.Errorf("ADD_MEM_REG split at %d: %v ack %d, %v", split, m.Request, v, err)
		}
		mustAccept(t, dev, "REM_MEM_REG", vmm.RemMemReg, p, small)
	}
	stillWorks(t, dev, c)
	c.roundTrip(d, "after", pattern(4, 5000))
}

// TestOversizedPayload: a size field above 4096 (the largest legal payload
// is far smaller) is skipped and refused; the connection stays in step.
func TestOversizedPayload(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	ev := eventfd(t)
	before := d.fdCount()
	for _, size := range []int{4097, 5000, 65536, 1 << 20} {
		for _, req := range []vmm.Request{vmm.SetMemTable, vmm.SetVringCall, vmm.SetFeatures, 99} {
			payload := pattern(size, size)
			if err := dev.Conn.Send(req, vmm.FlagNeedReply, payload, []int{ev, ev}); err != nil {
				t.Fatal(err)
			}
			m, err := dev.Conn.Recv()
			if err != nil {
				t.Fatalf("%v with %d payload bytes: %v", req, size, err)
			}
			if v, err := m.U64(); err != nil || v == 0 || m.Request != req {
				t.Errorf("%v with %d payload bytes: %v ack %d, %v; want a failure", req, size, m.Request, v, err)
			}
			connAlive(t, dev)
		}
	}
	// Without NEED_REPLY: skipped silently.
	if err := dev.Conn.Send(vmm.GetFeatures, 0, make([]byte, 8192), nil); err != nil {
		t.Fatal(err)
	}
	connAlive(t, dev)
	if after := d.fdCount(); after > before+2 {
		t.Errorf("daemon fds grew from %d to %d", before, after)
	}
	stillWorks(t, dev, c)
}

// TestStreamBroken: input after which the stream cannot be trusted (bad
// version bits, an absurd size, a message cut short by the disconnect):
// the daemon may give up on the connection, but it must exit cleanly (0
// or 1), without a crash.
func TestStreamBroken(t *testing.T) {
	type tc struct {
		name string
		send func(t *testing.T, cn *vmm.Conn)
		// exit1 is allowed (the daemon refused a broken stream);
		// otherwise a disconnect must exit 0.
		exit1 bool
	}
	cases := []tc{
		{"absurd-size", func(t *testing.T, cn *vmm.Conn) {
			cn.SendRaw(vmm.Header{Request: vmm.SetFeatures, Flags: vmm.FlagVersion, Size: 0xffffffff}, make([]byte, 64), nil)
		}, true},
		{"partial-header", func(t *testing.T, cn *vmm.Conn) {
			cn.SendBytes(vmm.Header{Request: vmm.GetFeatures, Flags: vmm.FlagVersion}.Bytes()[:7], nil)
		}, false},
		{"partial-payload", func(t *testing.T, cn *vmm.Conn) {
			cn.SendRaw(vmm.Header{Request: vmm.SetVringAddr, Flags: vmm.FlagVersion, Size: 40}, make([]byte, 20), nil)
		}, false},
		{"partial-payload-with-fds", func(t *testing.T, cn *vmm.Conn) {
			ev := eventfd(t)
			cn.SendRaw(vmm.Header{Request: vmm.SetMemTable, Flags: vmm.FlagVersion, Size: 72}, make([]byte, 30), []int{ev, ev})
		}, false},
	}
	for _, flags := range []uint32{0, 2, 3, vmm.FlagNeedReply, 0xfffffffe} {
		cases = append(cases, tc{fmt.Sprintf("version-flags-%#x", flags), func(t *testing.T, cn *vmm.Conn) {
			cn.SendRaw(vmm.Header{Request: vmm.GetFeatures, Flags: flags}, nil, nil)
		}, true})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t)
			d.allowExit1 = tc.exit1
			dev := d.connect(opts())
			newFS(t, dev, 1).mount()
			tc.send(t, dev.Conn)
			if tc.exit1 {
				// The daemon gives up: it closes its end by itself.
				if err := dev.Conn.WaitClosed(5 * time.Second); err != nil {
					t.Errorf("the daemon kept the connection: %v", err)
				}
			}
			dev.Conn.Close()
			d.checkExit(time.Now())
		})
	}
}

// TestStrayFds: fds attached to messages that take none (or more fds than
// a message takes) are closed, the message is handled as if they were not
// there, and the daemon's fd count does not grow.
func TestStrayFds(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	ev1, ev2, ev3 := eventfd(t), eventfd(t), eventfd(t)
	before := d.fdCount()
	for i := 0; i < 20; i++ {
		fds := []int{ev1, ev2, ev3}[:1+i%3]
		m, err := dev.Conn.CallFlags(vmm.GetFeatures, nil, fds, false)
		if err != nil {
			t.Fatalf("GET_FEATURES with %d fds: %v", len(fds), err)
		}
		if v, err := m.U64(); err != nil || v != wantFeatures {
			t.Fatalf("GET_FEATURES with %d fds: %#x, %v", len(fds), v, err)
		}
		m, err = dev.Conn.CallFlags(vmm.GetProtocolFeatures, nil, fds, false)
		if err != nil {
			t.Fatalf("GET_PROTOCOL_FEATURES with %d fds: %v", len(fds), err)
		}
		m.CloseFds()
		m, err = dev.Conn.CallFlags(vmm.GetQueueNum, nil, fds, false)
		if err != nil {
			t.Fatalf("GET_QUEUE_NUM with %d fds: %v", len(fds), err)
		}
		m.CloseFds()
		// SET_VRING_ENABLE on the running ring, with fds it does not take.
		if _, err := dev.Conn.CallFlags(vmm.SetVringEnable, vmm.VringState{Index: 1, Num: 1}.Bytes(), fds, true); err != nil {
			t.Fatalf("SET_VRING_ENABLE with %d stray fds: %v", len(fds), err)
		}
		c.check()
	}
	stillWorks(t, dev, c)
	if after := d.fdCount(); after > before+2 {
		t.Errorf("daemon fds grew from %d to %d: stray fds leak", before, after)
	}
}

// TestTooManyFds: a message carrying more than the 8 fds a vhost-user
// message may carry (the kernel closes those beyond the daemon's room) is
// refused when it takes fds, served when it takes none, and the connection
// and the daemon go on, with no fd kept.
func TestTooManyFds(t *testing.T) {
	d, dev, c := startAckAll(t, opts())
	fds := make([]int, 12)
	for i := range fds {
		fds[i] = eventfd(t)
	}
	before := d.fdCount()
	for range 10 {
		// SET_VRING_CALL takes one fd: with 12 attached it is refused.
		mustRefuse(t, dev, "SET_VRING_CALL with 12 fds", vmm.SetVringCall, vmm.U64(1), fds...)
		// SET_MEM_TABLE of 8 regions with 12 fds: refused, not half-mapped.
		mustRefuse(t, dev, "SET_MEM_TABLE with 12 fds", vmm.SetMemTable, vmm.MemTableBytes(make([]vmm.MemRegion, 8)), fds...)
		// GET_FEATURES takes none: answered, the fds closed.
		m, err := dev.Conn.CallFlags(vmm.GetFeatures, nil, fds, false)
		if err != nil {
			t.Fatalf("GET_FEATURES with 12 fds: %v", err)
		}
		if v, err := m.U64(); err != nil || v != wantFeatures {
			t.Fatalf("GET_FEATURES with 12 fds: %#x, %v", v, err)
		}
		c.check()
	}
	stillWorks(t, dev, c)
	if after := d.fdCount(); after > before+2 {
		t.Errorf("daemon fds grew from %d to %d", before, after)
	}
}
