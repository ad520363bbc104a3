package vmm

import (
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// loopDevice is a minimal in-process virtio device serving one Queue, for
// self-tests of the driver side without a daemon: it returns every chain
// with used length = its writable length, filling writable bytes with 0xd0.
// It keeps avail_event current with EVENT_IDX and notifies per the rules.
type loopDevice struct {
	q          *Queue
	mem        *Memory
	eventIdx   bool
	noNotify   bool // never signal (to test missed-notification detection)
	staleCall  int  // if >= 0, signal this fd instead of the current one
	lastAvail  uint16
	usedIdx    uint16
	signalled  uint16
	stop, done chan struct{}
}

func newLoopDevice(t *testing.T, size uint16, eventIdx bool) (*loopDevice, *Queue) {
	t.Helper()
	mem, err := NewMemory(SplitLayout(4*MiB, 4*MiB))
	if err != nil {
		t.Fatal(err)
	}
	q, err := NewQueue(mem, 1, QueueConfig{Size: size, EventIdx: eventIdx, Indirect: true, BufRegion: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.NewKickFd(); err != nil {
		t.Fatal(err)
	}
	d := &loopDevice{q: q, mem: mem, eventIdx: eventIdx, staleCall: -1,
		stop: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() {
		close(d.stop)
		<-d.done
		q.Close()
		mem.Close()
	})
	return d, q
}

func (d *loopDevice) run() {
	defer close(d.done)
	q := d.q
	q.mu.Lock()
	kick := q.kickFd
	q.mu.Unlock()
	for {
		select {
		case <-d.stop:
			return
		default:
		}
		p := []unix.PollFd{{Fd: int32(kick), Events: unix.POLLIN}}
		unix.Poll(p, 5)
		readEventfd(kick)
		for {
			d.drain()
			if !d.eventIdx {
				break
			}
			// Publish how far we got, then re-check (a full barrier is
			// implied by the CAS in store16).
			store16(q.used, 4+8*int(q.Size()), d.lastAvail)
			if load16(q.avail, 2) == d.lastAvail {
				break
			}
		}
	}
}

func (d *loopDevice) drain() {
	q := d.q
	n := q.Size()
	for load16(q.avail, 2) != d.lastAvail {
		head := le.Uint16(q.avail[4+2*int(d.lastAvail%n):])
		d.lastAvail++
		var wlen uint32
		desc := q.ReadDesc(head)
		next := q.ReadDesc
		if desc.Flags&DescIndirect != 0 {
			b := make([]byte, desc.Len)
			d.mem.ReadAt(b, desc.Addr)
			next = func(i uint16) Desc {
				e := b[int(i)*DescSize:]
				return Desc{le.Uint64(e), le.Uint32(e[8:]), le.Uint16(e[12:]), le.Uint16(e[14:])}
			}
			desc = next(0)
		}
		for {
			if desc.Flags&DescWrite != 0 {
				wlen += desc.Len
				fill := make([]byte, desc.Len)
				for j := range fill {
					fill[j] = 0xd0
				}
				d.mem.WriteAt(fill, desc.Addr)
			}
			if desc.Flags&DescNext == 0 {
				break
			}
			desc = next(desc.Next)
		}
		e := q.used[4+8*int(d.usedIdx%n):]
		le.PutUint32(e, uint32(head))
		le.PutUint32(e[4:], wlen)
		d.usedIdx++
		store16(q.used, 2, d.usedIdx) // publishes the element
		d.notify()
	}
}

func (d *loopDevice) notify() {
	q := d.q
	var need bool
	if d.eventIdx {
		need = NeedEvent(load16(q.avail, 4+2*int(q.Size())), d.usedIdx, d.signalled)
	} else {
		need = load16(q.avail, 0)&AvailNoInterrupt == 0
	}
	d.signalled = d.usedIdx
	if !need || d.noNotify {
		return
	}
	fd := q.CallFd()
	if d.staleCall >= 0 {
		fd = d.staleCall
	}
	unix.Write(fd, U64(1))
}

func TestLoopbackConcurrent(t *testing.T) {
	for _, eventIdx := range []bool{true, false} {
		d, q := newLoopDevice(t, 64, eventIdx)
		go d.run()
		var wg sync.WaitGroup
		const workers, per = 4, 300
		errs := make(chan error, workers)
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range per {
					in := BuildRequest(InHeader{Opcode: OpGetattr, Unique: uint64(w*per + i)}, 0, make([]byte, 16))
					mode := IndirectAuto
					if i%3 == 0 {
						mode = IndirectNever
					}
					var fc *FuseCall
					var err error
					for {
						fc, err = q.SubmitFuse(FuseRequest{In: in, OutArgs: 104, OutPages: 5000, Indirect: mode})
						if !errors.Is(err, ErrRingFull) {
							break
						}
						time.Sleep(time.Millisecond)
					}
					if err != nil {
						errs <- err
						return
					}
					b, err := fc.Wait(5 * time.Second)
					if err != nil {
						errs <- err
						return
					}
					if len(b) != 16+104+5000 || b[0] != 0xd0 || b[len(b)-1] != 0xd0 {
						errs <- errors.New("bad reply bytes")
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("eventIdx=%v: %v", eventIdx, err)
		}
		if v := q.Violations(); len(v) != 0 {
			t.Fatal(v)
		}
		if q.NumFree() != 64 || q.InFlight() != 0 {
			t.Fatalf("free %d in flight %d", q.NumFree(), q.InFlight())
		}
		st := q.Stats()
		t.Logf("eventIdx=%v: %d requests, %+v", eventIdx, workers*per, st)
		if eventIdx && st.Kicks >= workers*per {
			t.Errorf("EVENT_IDX did not suppress any kick: %+v", st)
		}
	}
}

func TestLoopbackMissedNotification(t *testing.T) {
	d, q := newLoopDevice(t, 16, true)
	d.noNotify = true
	go d.run()
	fc, err := q.SubmitFuse(FuseRequest{In: make([]byte, 40), OutArgs: 8})
	if err != nil {
		t.Fatal(err)
	}
	_, err = fc.Wait(300 * time.Millisecond)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "missing call notification") {
		t.Fatalf("got %v, want a missed-notification timeout", err)
	}
	// A guest would eventually poll; so can a test.
	if got := q.Harvest(); len(got) != 1 {
		t.Fatalf("harvest: %v", got)
	}
}

func TestLoopbackStaleCallFd(t *testing.T) {
	d, q := newLoopDevice(t, 16, false)
	old := q.CallFd()
	if _, err := q.NewCallFd(); err != nil {
		t.Fatal(err)
	}
	d.staleCall = old // a back end that kept the first call fd
	go d.run()
	fc, err := q.SubmitFuse(FuseRequest{In: make([]byte, 40), OutArgs: 8})
	if err != nil {
		t.Fatal(err)
	}
	// Within the grace period the stale fd is still honoured...
	if _, err := fc.Wait(time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(staleGrace + 100*time.Millisecond)
	// ...after it, its signals are lost interrupts.
	fc, err = q.SubmitFuse(FuseRequest{In: make([]byte, 40), OutArgs: 8})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fc.Wait(300 * time.Millisecond); !errors.Is(err, ErrTimeout) {
		t.Fatalf("got %v, want a timeout", err)
	}
	if st := q.Stats(); st.Lost == 0 {
		t.Fatalf("no lost interrupt counted: %+v", st)
	}
}

func TestMemory(t *testing.T) {
	m, err := NewMemory(append(SharedLayout(2*MiB, 2*MiB),
		RegionSpec{GuestPhysAddr: 8 * GiB, Size: 1 * MiB, File: 5},
		RegionSpec{GuestPhysAddr: 8*GiB + 1*MiB, Size: 1 * MiB, File: 0, MmapOffset: 4 * MiB}))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	regs := m.Regions()
	if regs[1].Fd() != regs[0].Fd() || regs[3].Fd() != regs[0].Fd() || regs[2].Fd() == regs[0].Fd() {
		t.Fatal("memfd sharing is wrong")
	}
	for _, r := range regs {
		if r.UserAddr == r.GuestPhysAddr {
			t.Errorf("region at %#x: HVA equals GPA", r.GuestPhysAddr)
		}
	}
	// Writes through one region are visible at the shared memfd offset.
	if err := m.WriteAt([]byte("high"), 4*GiB); err != nil {
		t.Fatal(err)
	}
	if string(m.maps[0][2*MiB:2*MiB+4]) != "high" {
		t.Fatal("high region is not at mmap_offset 2 MiB of the shared memfd")
	}
	// A range across the GPA-contiguous regions 2 and 3.
	b := uint64(8*GiB + 1*MiB - 3)
	if err := m.AllocAt(b, 6); err != nil {
		t.Fatal(err)
	}
	if err := m.WriteAt([]byte("abcdef"), b); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 6)
	m.ReadAt(got, b)
	if string(got) != "abcdef" || string(m.maps[0][4*MiB:4*MiB+3]) != "def" {
		t.Fatalf("straddling write: %q", got)
	}
	if _, err := m.Slice(b, 6); err == nil {
		t.Fatal("Slice across regions succeeded")
	}
	if err := m.AllocAt(b+2, 1); err == nil {
		t.Fatal("AllocAt over an allocation succeeded")
	}
	m.Free(b)
	if err := m.AllocAt(b+2, 1); err != nil {
		t.Fatal(err)
	}
	// Alloc alignment, region choice, and reuse after Free.
	a, err := m.AllocIn(1, 100, 4096)
	if err != nil || a%4096 != 0 || m.Region(a) != regs[1] {
		t.Fatalf("AllocIn: %#x %v", a, err)
	}
	m.Free(a)
	if a2, _ := m.AllocIn(1, 100, 4096); a2 != a {
		t.Fatalf("freed space not reused: %#x vs %#x", a2, a)
	}
	if _, err := m.Alloc(64*MiB, 8); err == nil {
		t.Fatal("oversized Alloc succeeded")
	}
	if h, _ := m.HVA(4*GiB + 5); h != regs[1].UserAddr+5 {
		t.Fatalf("HVA: %#x", h)
	}
	if m.Region(m.Unmapped()) != nil {
		t.Fatal("Unmapped is mapped")
	}
}

func TestConnFraming(t *testing.T) {
	a, bf, err := SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b := NewConn(int(bf.Fd()))
	defer bf.Close()
	efd, _ := eventfd(0)
	defer unix.Close(efd)
	go func() {
		m, err := b.Recv()
		if err != nil {
			return
		}
		m.CloseFds()
		if m.Request == GetVringBase {
			b.Reply(m, VringState{le.Uint32(m.Payload), 42}.Bytes())
		}
		m, err = b.Recv()
		if err != nil {
			return
		}
		m.CloseFds()
		b.SendRaw(Header{GetFeatures, FlagVersion, 8}, U64(1), nil) // wrong flags
	}()
	base, err := a.GetVringBase(3)
	if err != nil || base != 42 {
		t.Fatalf("GetVringBase: %d %v", base, err)
	}
	if _, err := a.GetFeatures(); err == nil || !strings.Contains(err.Error(), "flags") {
		t.Fatalf("reply with flags 0x1 accepted: %v", err)
	}
	// Partial message then EOF.
	if err := a.SendBytes(Header{SetOwner, FlagVersion, 8}.Bytes()[:5], []int{efd}); err != nil {
		t.Fatal(err)
	}
	a.Shutdown()
	if _, err := b.Recv(); err == nil {
		t.Fatal("partial message decoded")
	}
}

func TestServeFSIO(t *testing.T) {
	ours, theirs, err := SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New(ours, DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	backOurs, backTheirs, err := SocketPair() // the backend channel
	if err != nil {
		t.Fatal(err)
	}
	dev.Backend = backOurs
	daemon := NewConn(int(backTheirs.Fd()))
	defer theirs.Close()
	defer backTheirs.Close()
	dev.ServeBackend(dev.ServeFSIO)

	f, err := os.CreateTemp(t.TempDir(), "fsio")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.WriteString("0123456789")
	gpa, _ := dev.Mem.Alloc(16, 8)
	dev.Mem.WriteAt([]byte("ABCD"), gpa+8)
	var io FSIO
	io.FdOffset[0], io.COffset[0], io.Len[0], io.Flags[0] = 2, gpa, 100, FSIORead   // short: 8 bytes
	io.FdOffset[1], io.COffset[1], io.Len[1], io.Flags[1] = 10, gpa+8, 4, FSIOWrite // appends ABCD
	if err := daemon.Send(BackendFSIO, FlagNeedReply, io.Bytes(), []int{int(f.Fd())}); err != nil {
		t.Fatal(err)
	}
	// The read is clamped at EOF (8 bytes), which ends the transfer.
	m, err := daemon.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := m.U64(); m.Flags != ReplyFlags || v != 8 {
		t.Fatalf("FS_IO reply flags %#x value %d", m.Flags, v)
	}
	got := make([]byte, 8)
	dev.Mem.ReadAt(got, gpa)
	if string(got) != "23456789" {
		t.Fatalf("guest memory holds %q", got)
	}
	// Unknown requests get 1.
	daemon.Send(BackendConfigChangeMsg, FlagNeedReply, nil, nil)
	if m, err := daemon.Recv(); err != nil {
		t.Fatal(err)
	} else if v, _ := m.U64(); v != 1 {
		t.Fatalf("unknown request answered %d", v)
	}
}
