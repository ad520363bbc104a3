package vmm

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeBackend is a vhost-user back end inside the test process, enough to
// check Device's side of packed rings: it answers the start-up messages,
// records what the rings are set up with, and serves each packed ring with
// a packedDevice from SET_VRING_KICK to GET_VRING_BASE, starting at the
// SET_VRING_BASE it was given and answering GET_VRING_BASE with where it
// stopped. It shares the test's address space, so it uses the Queues' ring
// memory instead of mapping the memory table.
type fakeBackend struct {
	t       *testing.T
	conn    *Conn
	file    *os.File // keeps conn's fd open
	dev     *Device
	offered uint64
	done    chan struct{}

	mu       sync.Mutex
	features uint64
	nums     map[uint32][]uint32 // every SET_VRING_NUM per ring
	bases    map[uint32][]uint32 // every SET_VRING_BASE per ring
	addrs    map[uint32]VringAddr
	rings    map[uint32]*packedDevice // running rings
	errs     []error
}

func startFakeBackend(t *testing.T, offered uint64, opts Options) (*fakeBackend, *Device) {
	t.Helper()
	ours, theirs, err := SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	dev, err := New(ours, opts)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeBackend{t: t, conn: NewConn(int(theirs.Fd())), file: theirs, dev: dev, offered: offered,
		done: make(chan struct{}), nums: map[uint32][]uint32{}, bases: map[uint32][]uint32{},
		addrs: map[uint32]VringAddr{}, rings: map[uint32]*packedDevice{}}
	go f.serve()
	t.Cleanup(func() {
		// The rings first: closing the Device unmaps their memory.
		f.mu.Lock()
		for i := range f.rings {
			f.stopRing(i)
		}
		f.mu.Unlock()
		dev.Close()
		<-f.done
		theirs.Close()
		for _, err := range f.errs {
			t.Error(err)
		}
	})
	return f, dev
}

func (f *fakeBackend) serve() {
	defer close(f.done)
	for {
		m, err := f.conn.RecvTimeout(-1)
		if err != nil {
			return
		}
		f.mu.Lock()
		err = f.handle(m)
		f.mu.Unlock()
		m.CloseFds()
		if err != nil {
			f.mu.Lock()
			f.errs = append(f.errs, fmt.Errorf("fake back end: %v: %w", m.Request, err))
			f.mu.Unlock()
			return
		}
	}
}

func (f *fakeBackend) handle(m *Message) error {
	u32 := func(off int) uint32 { return le.Uint32(m.Payload[off:]) }
	switch m.Request {
	case GetFeatures:
		return f.conn.Reply(m, U64(f.offered))
	case GetProtocolFeatures:
		return f.conn.Reply(m, U64(0))
	case SetFeatures:
		f.features = le.Uint64(m.Payload)
	case SetProtocolFeatures, SetOwner, SetMemTable, SetVringCall, SetVringErr, SetVringEnable:
	case SetVringNum:
		f.nums[u32(0)] = append(f.nums[u32(0)], u32(4))
	case SetVringBase:
		f.bases[u32(0)] = append(f.bases[u32(0)], u32(4))
	case SetVringAddr:
		f.addrs[u32(0)] = VringAddr{Index: u32(0), Flags: u32(4), Desc: le.Uint64(m.Payload[8:]),
			Used: le.Uint64(m.Payload[16:]), Avail: le.Uint64(m.Payload[24:]), Log: le.Uint64(m.Payload[32:])}
	case SetVringKick:
		i := u32(0) & VringIdxMask
		if f.features&Bit(FRingPacked) == 0 || len(m.Fds) != 1 {
			return nil
		}
		bases := f.bases[i]
		if len(bases) == 0 {
			return errors.New("no SET_VRING_BASE before SET_VRING_KICK")
		}
		d := attachPackedDevice(f.dev.Queues[i], f.features&Bit(FEventIdx) != 0, m.Fds[0])
		m.Fds = nil // the device's now
		d.at(ParsePackedBase(bases[len(bases)-1]))
		d.run()
		f.rings[i] = d
	case GetVringBase:
		i := u32(0)
		var base uint32
		if d := f.rings[i]; d != nil {
			base = f.stopRing(i).Uint32()
		}
		return f.conn.Reply(m, VringState{i, base}.Bytes())
	default:
		return errors.New("unexpected")
	}
	return nil
}

// stopRing halts ring i's device and returns where it stopped.
func (f *fakeBackend) stopRing(i uint32) PackedBase {
	d := f.rings[i]
	d.halt()
	unix.Close(d.kickFd)
	delete(f.rings, i)
	if d.err != nil {
		f.errs = append(f.errs, fmt.Errorf("ring %d: %w", i, d.err))
	}
	return d.base()
}

// last returns the last SET_VRING_NUM and SET_VRING_BASE of ring i, once
// the back end has handled every message sent so far (they have no reply:
// a GET_FEATURES is the barrier, as QEMU uses it).
func (f *fakeBackend) last(i uint32) (num, base uint32) {
	f.sync()
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.nums[i][len(f.nums[i])-1], f.bases[i][len(f.bases[i])-1]
}

func (f *fakeBackend) sync() {
	if _, err := f.dev.Conn.GetFeatures(); err != nil {
		f.t.Fatal(err)
	}
}

func packedOptions() Options {
	o := DefaultOptions()
	o.Layout = SplitLayout(4*MiB, 4*MiB)
	o.QueueSize = 7
	o.RequireFeatures = Bit(FRingPacked)
	o.Timeout = 2 * time.Second
	return o
}

// TestPackedDeviceLifecycle: Device negotiates packed rings, sets them up
// at PackedResetBase with a size that is not a power of 2 and their packed
// addresses, and carries GET_VRING_BASE's 32 bits into SET_VRING_BASE
// across Stop/Restart, StopQueue/RestartQueue, a ring reset and a guest
// reboot; requests keep completing throughout.
func TestPackedDeviceLifecycle(t *testing.T) {
	f, dev := startFakeBackend(t, DefaultFeatures|Bit(FRingPacked), packedOptions())
	if err := dev.Init(); err != nil {
		t.Fatal(err)
	}
	if err := dev.StartRings(); err != nil {
		t.Fatal(err)
	}
	if !dev.Packed() {
		t.Fatal("packed rings not negotiated")
	}
	for i, q := range dev.Queues {
		if !q.Packed() {
			t.Fatalf("ring %d is not packed", i)
		}
		num, base := f.last(uint32(i))
		if num != 7 || base != PackedResetBase {
			t.Fatalf("ring %d set up with SET_VRING_NUM %d, SET_VRING_BASE %#x", i, num, base)
		}
		f.sync()
		f.mu.Lock()
		a := f.addrs[uint32(i)]
		f.mu.Unlock()
		if a.Avail != a.Desc+7*DescSize || a.Used != a.Avail+4 || a.Log != q.Addrs().Used {
			t.Fatalf("ring %d: SET_VRING_ADDR %+v does not place the event areas after 7 descriptors", i, a)
		}
	}
	q := dev.Queue(1)
	requests := 0
	submit := func(n int) {
		t.Helper()
		for range n {
			r := FuseRequest{In: getattrReq(uint64(requests)), OutArgs: 8}
			if requests%2 == 0 {
				r.Indirect = IndirectNever // 4 slots
			}
			requests++
			fc, err := q.SubmitFuse(r)
			if err != nil {
				t.Fatal(err)
			}
			b, err := fc.Wait(2 * time.Second)
			if err == nil {
				err = checkReply(b, 8, 0)
			}
			if err != nil {
				t.Fatalf("request %d: %v", requests, err)
			}
		}
	}
	var availWraps, usedWraps [2]bool
	for round := range 12 {
		submit(1 + round%4)
		bases, err := dev.Stop()
		if err != nil {
			t.Fatal(err)
		}
		for i, b := range bases {
			if want := dev.Queue(i).IdleBase(); b != want {
				t.Fatalf("round %d ring %d: GET_VRING_BASE %v, driver at %v", round, i, ParsePackedBase(b), ParsePackedBase(want))
			}
		}
		b := ParsePackedBase(bases[1])
		availWraps[b2i(b.AvailWrap)], usedWraps[b2i(b.UsedWrap)] = true, true
		if err := dev.Restart(false); err != nil {
			t.Fatal(err)
		}
		for i := range bases {
			if _, base := f.last(uint32(i)); base != bases[i] {
				t.Fatalf("round %d ring %d: restarted at %#x, stopped at %#x", round, i, base, bases[i])
			}
		}
	}
	if availWraps != [2]bool{true, true} || usedWraps != [2]bool{true, true} {
		t.Fatalf("stops did not see both wrap counter values: avail %v used %v", availWraps, usedWraps)
	}

	// One ring alone.
	base, err := dev.StopQueue(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.RestartQueue(1, base, false); err != nil {
		t.Fatal(err)
	}
	if _, b := f.last(1); b != base {
		t.Fatalf("RestartQueue at %#x sent %#x", base, b)
	}
	submit(3)
	// A driver reset of that ring: base 0 stands for a fresh packed ring.
	if _, err := dev.StopQueue(1); err != nil {
		t.Fatal(err)
	}
	if err := dev.RestartQueue(1, 0, true); err != nil {
		t.Fatal(err)
	}
	if _, b := f.last(1); b != PackedResetBase {
		t.Fatalf("a reset ring restarted at %#x", b)
	}
	submit(9)
	// A guest reboot.
	if err := dev.GuestReset(); err != nil {
		t.Fatal(err)
	}
	for i := range dev.Queues {
		if _, b := f.last(uint32(i)); b != PackedResetBase {
			t.Fatalf("ring %d restarted at %#x after a reboot", i, b)
		}
	}
	submit(10)
	for _, q := range dev.Queues {
		if v := q.Violations(); len(v) != 0 {
			t.Fatal(v)
		}
	}
}

// TestPackedDeviceNotOffered: packed rings in Features fall back to split
// rings when the back end does not offer them (as QEMU's packed=on does);
// in RequireFeatures they make Init fail.
func TestPackedDeviceNotOffered(t *testing.T) {
	o := packedOptions()
	o.RequireFeatures = 0
	o.Features = DefaultFeatures | Bit(FRingPacked)
	f, dev := startFakeBackend(t, DefaultFeatures, o)
	if !dev.Queue(1).Packed() {
		t.Fatal("a ring that asks for packed is not laid out packed before negotiation")
	}
	if err := dev.Init(); err != nil {
		t.Fatal(err)
	}
	if err := dev.StartRings(); err != nil {
		t.Fatal(err)
	}
	if dev.Packed() || dev.Queue(1).Packed() {
		t.Fatal("packed rings without the back end offering them")
	}
	if _, base := f.last(1); base != 0 {
		t.Fatalf("split ring set up at base %#x", base)
	}
	f.sync()
	f.mu.Lock()
	a := f.addrs[1]
	f.mu.Unlock()
	dl, al, _ := RingBytes(7)
	if a.Avail != a.Desc+dl || a.Used != (a.Desc+dl+al+63)&^63 {
		t.Fatalf("the fallback ring is not laid out split: %+v", a)
	}
	_ = dev.Queue(1).UsedIdx() // the split accessors work

	o.RequireFeatures = Bit(FRingPacked)
	_, dev = startFakeBackend(t, DefaultFeatures, o)
	if err := dev.Init(); !errors.Is(err, ErrNotOffered) {
		t.Fatalf("Init without the required packed rings: %v", err)
	}
	if dev.Options().Features&Bit(FRingPacked) == 0 {
		t.Fatal("RequireFeatures is not implied in Features")
	}
}
