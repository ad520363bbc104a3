package vmm

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// packedDevice is a minimal in-process device serving one packed Queue,
// the packed counterpart of loopDevice, written from the device's side of
// the spec: it reads chains in ring order (copying them out, as a device
// must, since used descriptors overwrite the slots of chains still in
// flight), returns each with used len = its writable length after filling
// the writable bytes with 0xd0, asks for kicks through the device event
// area and sends interrupts as the driver event area says.
//
// Tests either call serve from their own goroutine, one step at a time, or
// run it in a goroutine with run.
type packedDevice struct {
	q        *Queue
	mem      *Memory
	size     uint16
	eventIdx bool
	// The ring, as SET_VRING_ADDR gave it: copied from q under its lock
	// (a Reset may move q's).
	desc, driver, device []byte

	// Knobs, set before run.
	reverse   bool   // return each batch of chains in reverse order (out-of-order completion)
	noNotify  bool   // never signal
	kickFlags uint16 // device event flags without EVENT_IDX (EventFlagEnable or EventFlagDisable)
	kickFd    int    // where kicks arrive (run only)
	callFd    int    // where interrupts go; <0: the queue's current call fd

	// Device state.
	availIdx  uint16
	availWrap bool
	usedIdx   uint16
	usedWrap  bool
	moved     uint16 // used slots since the last interrupt decision
	err       error  // the ring is broken (a driver bug): stop serving

	// What happened, for the tests' assertions.
	popped, wrapped, indirect, outOfOrder, signals int

	stop, done chan struct{}
}

// popped is a chain copied out of the ring.
type poppedChain struct {
	id    uint16
	slots int
	write []Segment
	seq   int // pop order
}

func newPackedDevice(t *testing.T, size uint16, eventIdx bool) (*packedDevice, *Queue) {
	t.Helper()
	mem, err := NewMemory(SplitLayout(4*MiB, 4*MiB))
	if err != nil {
		t.Fatal(err)
	}
	q, err := NewQueue(mem, 1, QueueConfig{Size: size, EventIdx: eventIdx, Indirect: true, BufRegion: 1, Packed: true})
	if err != nil {
		t.Fatal(err)
	}
	kick, err := q.NewKickFd()
	if err != nil {
		t.Fatal(err)
	}
	d := attachPackedDevice(q, eventIdx, kick)
	t.Cleanup(func() {
		d.halt()
		q.Close()
		mem.Close()
	})
	return d, q
}

// attachPackedDevice makes a device for q's ring as it is now, at the
// positions of a fresh ring.
func attachPackedDevice(q *Queue, eventIdx bool, kickFd int) *packedDevice {
	q.mu.Lock()
	defer q.mu.Unlock()
	return &packedDevice{q: q, mem: q.mem, size: q.cfg.Size, eventIdx: eventIdx, kickFd: kickFd, callFd: -1,
		desc: q.desc, driver: q.avail, device: q.used, availWrap: true, usedWrap: true}
}

// at sets the device's positions, as SET_VRING_BASE does.
func (d *packedDevice) at(b PackedBase) {
	d.availIdx, d.availWrap, d.usedIdx, d.usedWrap = b.AvailIdx, b.AvailWrap, b.UsedIdx, b.UsedWrap
}

// base is what GET_VRING_BASE answers.
func (d *packedDevice) base() PackedBase {
	return PackedBase{d.availIdx, d.availWrap, d.usedIdx, d.usedWrap}
}

// pop copies out the chain at the device's next avail slot, if one is
// available.
func (d *packedDevice) pop() (*poppedChain, bool) {
	if _, flags := loadTail(d.desc, d.availIdx); !IsAvail(flags, d.availWrap) {
		return nil, false
	}
	c := &poppedChain{seq: d.popped}
	slot, wrap := d.availIdx, d.availWrap
	for {
		if c.slots == int(d.size) {
			d.err = fmt.Errorf("chain at slot %d longer than the ring", d.availIdx)
			return nil, false
		}
		desc := readPackedDesc(d.desc, slot)
		if !IsAvail(desc.Flags, wrap) {
			d.err = fmt.Errorf("chain at slot %d continues into slot %d, which is not available", d.availIdx, slot)
			return nil, false
		}
		c.slots++
		c.id = desc.ID // the last descriptor's id is the buffer id
		if desc.Flags&DescIndirect != 0 {
			d.indirect++
			b := make([]byte, desc.Len)
			if err := d.mem.ReadAt(b, desc.Addr); err != nil || desc.Len%DescSize != 0 {
				d.err = fmt.Errorf("bad indirect table at slot %d", slot)
				return nil, false
			}
			for e := b; len(e) > 0; e = e[DescSize:] {
				if le.Uint16(e[14:])&DescWrite != 0 {
					c.write = append(c.write, Segment{le.Uint64(e), le.Uint32(e[8:]), true})
				}
			}
		} else if desc.Flags&DescWrite != 0 {
			c.write = append(c.write, Segment{desc.Addr, desc.Len, true})
		}
		next, nwrap := advance(slot, wrap, 1, d.size)
		if desc.Flags&DescNext == 0 {
			slot, wrap = next, nwrap
			break
		}
		if next == 0 {
			d.wrapped++
		}
		slot, wrap = next, nwrap
	}
	d.availIdx, d.availWrap = slot, wrap
	d.popped++
	return c, true
}

// complete returns c: the used descriptor's id and len first, its flags
// (with this lap's AVAIL and USED) last.
func (d *packedDevice) complete(c *poppedChain) {
	var n uint32
	for _, s := range c.write {
		fill := make([]byte, s.Len)
		for i := range fill {
			fill[i] = 0xd0
		}
		d.mem.WriteAt(fill, s.Addr)
		n += s.Len
	}
	le.PutUint32(d.desc[int(d.usedIdx)*DescSize+8:], n)
	flags := usedBits(d.usedWrap)
	if n > 0 {
		flags |= DescWrite
	}
	storeTail(d.desc, d.usedIdx, c.id, flags)
	d.usedIdx, d.usedWrap = advance(d.usedIdx, d.usedWrap, c.slots, d.size)
	d.moved += uint16(c.slots)
}

// notify sends an interrupt if the driver event area asks for one. The
// store of the last used descriptor's flags was a full barrier.
func (d *packedDevice) notify() {
	if d.moved == 0 {
		return
	}
	off, flags := loadEvent(d.driver)
	var need bool
	switch flags {
	case EventFlagEnable:
		need = true
	case EventFlagDesc:
		need = PackedNeedEvent(off, d.size, d.usedIdx, d.usedIdx-d.moved, d.usedWrap)
	}
	d.moved = 0
	if !need || d.noNotify {
		return
	}
	d.signals++
	fd := d.callFd
	if fd < 0 {
		fd = d.q.CallFd()
	}
	unix.Write(fd, U64(1))
}

// serve pops every available chain, then returns them (in reverse with
// d.reverse) and notifies; then it asks for the next kick and looks again,
// as a device going back to sleep must. It returns the chains served.
func (d *packedDevice) serve() int {
	total := 0
	for d.err == nil {
		var batch []*poppedChain
		for {
			c, ok := d.pop()
			if !ok {
				break
			}
			batch = append(batch, c)
		}
		if d.reverse && len(batch) > 1 {
			d.outOfOrder += len(batch) - 1
			for i, j := 0, len(batch)-1; i < j; i, j = i+1, j-1 {
				batch[i], batch[j] = batch[j], batch[i]
			}
		}
		for _, c := range batch {
			d.complete(c)
			if !d.reverse {
				d.notify()
			}
		}
		d.notify()
		total += len(batch)
		// Kick suppression: with EVENT_IDX a kick when the driver makes
		// our next avail slot available; the store is a full barrier
		// before the re-check.
		flags := d.kickFlags
		var off uint16
		if d.eventIdx {
			off, flags = OffWrap(d.availIdx, d.availWrap), EventFlagDesc
		}
		storeEvent(d.device, off, flags)
		if _, f := loadTail(d.desc, d.availIdx); !IsAvail(f, d.availWrap) {
			break
		}
	}
	return total
}

// run serves the ring from a goroutine until halt, woken by kicks and
// every 5 ms.
func (d *packedDevice) run() {
	d.stop, d.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(d.done)
		for {
			select {
			case <-d.stop:
				return
			default:
			}
			unix.Poll([]unix.PollFd{{Fd: int32(d.kickFd), Events: unix.POLLIN}}, 5)
			readEventfd(d.kickFd)
			d.serve()
		}
	}()
}

func (d *packedDevice) halt() {
	if d.stop != nil {
		close(d.stop)
		<-d.done
		d.stop = nil
	}
}

func getattrReq(unique uint64) []byte {
	return BuildRequest(InHeader{Opcode: OpGetattr, Unique: unique}, 0, make([]byte, 16))
}

// checkReply checks a loop device's reply to a request with outArgs and
// outPages reply bytes.
func checkReply(b []byte, outArgs, outPages int) error {
	if len(b) != FuseOutHeaderSize+outArgs+outPages {
		return fmt.Errorf("reply of %d bytes, want %d", len(b), FuseOutHeaderSize+outArgs+outPages)
	}
	for i, c := range b {
		if c != 0xd0 {
			return fmt.Errorf("reply byte %d is %#x", i, c)
		}
	}
	return nil
}

func TestPackedBase(t *testing.T) {
	if b := ParsePackedBase(PackedResetBase); b != (PackedBase{0, true, 0, true}) {
		t.Fatalf("reset base decodes as %v", b)
	}
	for _, b := range []PackedBase{{0, true, 0, true}, {6, false, 3, true}, {32767, true, 32767, false}, {1, false, 0, false}} {
		if got := ParsePackedBase(b.Uint32()); got != b {
			t.Errorf("%v -> %#x -> %v", b, b.Uint32(), got)
		}
	}
	if v := (PackedBase{5, false, 2, true}).Uint32(); v != 0x80020005 {
		t.Errorf("encoding: %#x", v)
	}
}

// TestPackedWrap drives a ring of 7 synchronously with 3-slot direct
// chains: the third one takes slots 6, 0 and 1, so the driver's avail wrap
// counter flips inside it.
func TestPackedWrap(t *testing.T) {
	d, q := newPackedDevice(t, 7, false)
	segs := func() []Segment {
		var s []Segment
		for _, w := range []bool{false, false, true} {
			a, err := q.mem.AllocIn(1, 64, 8)
			if err != nil {
				t.Fatal(err)
			}
			s = append(s, Segment{a, 64, w})
		}
		return s
	}
	for round := range 20 {
		head, wrap := q.NextAvail()
		c, err := q.Add(segs(), IndirectNever)
		if err != nil {
			t.Fatal(err)
		}
		// The chain as the device will see it.
		for i := range 3 {
			slot, w := advance(head, wrap, i, 7)
			desc := q.ReadPackedDesc(slot)
			want := availBits(w) | DescNext
			if i == 2 {
				want = availBits(w) | DescWrite
			}
			if desc.Flags != want || uint32(desc.ID) != c.Head {
				t.Fatalf("round %d: slot %d (descriptor %d of the chain): flags %#x id %d, want %#x id %d",
					round, slot, i, desc.Flags, desc.ID, want, c.Head)
			}
		}
		if got := q.IdleBase(); ParsePackedBase(got).AvailIdx != (head+3)%7 {
			t.Fatalf("round %d: next avail %v", round, ParsePackedBase(got))
		}
		if n := d.serve(); n != 1 {
			t.Fatalf("round %d: device served %d chains (%v)", round, n, d.err)
		}
		q.Interrupt()
		n, err := c.Wait(time.Second)
		if err != nil || n != 64 {
			t.Fatalf("round %d: used len %d, %v", round, n, err)
		}
		if b := q.IdleBase(); b != d.base().Uint32() {
			t.Fatalf("round %d: driver idle at %v, device at %v", round, ParsePackedBase(b), d.base())
		}
	}
	if d.wrapped == 0 {
		t.Fatal("no chain wrapped from the last slot to slot 0")
	}
	if q.NumFree() != 7 || q.InFlight() != 0 || len(q.Violations()) != 0 {
		t.Fatalf("free %d in flight %d violations %v", q.NumFree(), q.InFlight(), q.Violations())
	}
}

// TestPackedIndirect: an indirect chain takes one slot; its table has no
// NEXT, and WRITE only on the writable entries.
func TestPackedIndirect(t *testing.T) {
	d, q := newPackedDevice(t, 7, false)
	for round := range 10 {
		fc, err := q.AddFuse(FuseRequest{In: getattrReq(uint64(round)), OutArgs: 104, OutPages: 5000, Indirect: IndirectAlways})
		if err != nil {
			t.Fatal(err)
		}
		if q.NumFree() != 6 {
			t.Fatalf("an indirect chain took %d slots", 7-q.NumFree())
		}
		head, _ := q.NextAvail()
		desc := q.ReadPackedDesc((head + 6) % 7)
		if desc.Flags&^(DescAvail|DescUsed) != DescIndirect || desc.Len != 6*DescSize {
			t.Fatalf("indirect descriptor %+v", desc)
		}
		table := make([]byte, desc.Len)
		q.mem.ReadAt(table, desc.Addr)
		for i := range 6 {
			want := uint16(0) // header and arguments
			if i >= 2 {
				want = DescWrite
			}
			if f := le.Uint16(table[i*DescSize+14:]); f != want {
				t.Fatalf("table entry %d flags %#x, want %#x", i, f, want)
			}
		}
		d.serve()
		q.Interrupt()
		b, err := fc.Wait(time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkReply(b, 104, 5000); err != nil {
			t.Fatal(err)
		}
	}
	if d.indirect != 10 {
		t.Fatalf("device saw %d indirect descriptors", d.indirect)
	}
}

// TestPackedOutOfOrder: the device returns batches in reverse; the driver
// frees each chain by id and its used index moves by the slots each took.
func TestPackedOutOfOrder(t *testing.T) {
	d, q := newPackedDevice(t, 7, false)
	d.reverse = true
	for round := range 30 {
		var calls []*FuseCall
		for i := range 3 {
			mode := IndirectAlways
			if (round+i)%2 == 0 {
				mode = IndirectNever // 2 readable + 1 writable: 3 slots
			}
			fc, err := q.AddFuse(FuseRequest{In: getattrReq(uint64(i)), OutArgs: 0, Indirect: mode})
			if errors.Is(err, ErrRingFull) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			calls = append(calls, fc)
		}
		d.serve()
		q.Interrupt()
		hist := q.History()
		hist = hist[len(hist)-len(calls):]
		for i, fc := range calls {
			b, err := fc.Wait(time.Second)
			if err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			if err := checkReply(b, 0, 0); err != nil {
				t.Fatal(err)
			}
			if hist[len(calls)-1-i].ID != fc.Head {
				t.Fatalf("round %d: used order %v, want the reverse of the submissions", round, hist)
			}
		}
		if b := q.IdleBase(); b != d.base().Uint32() {
			t.Fatalf("round %d: driver idle at %v, device at %v", round, ParsePackedBase(b), d.base())
		}
	}
	if d.outOfOrder == 0 || d.wrapped == 0 {
		t.Fatalf("out of order %d, wrapped %d", d.outOfOrder, d.wrapped)
	}
	if v := q.Violations(); len(v) != 0 {
		t.Fatal(v)
	}
}

// TestPackedKickDecision checks Notify against the device event area,
// including an event offset in the lap before the driver's.
func TestPackedKickDecision(t *testing.T) {
	d, q := newPackedDevice(t, 7, true)
	setDev := func(off, flags uint16) { storeEvent(d.device, off, flags) }
	add := func(n int) {
		t.Helper()
		var segs []Segment
		for range n {
			a, _ := q.mem.AllocIn(1, 16, 8)
			segs = append(segs, Segment{a, 16, false})
		}
		if _, err := q.Add(segs, IndirectNever); err != nil {
			t.Fatal(err)
		}
	}
	drain := func() {
		t.Helper()
		q.Notify() // forget what was added
		d.serve()
		q.Interrupt()
	}
	// Bring the driver to slot 6 of the first lap.
	add(3)
	add(3)
	drain()
	if i, w := q.NextAvail(); i != 6 || !w {
		t.Fatalf("next avail %d wrap %v", i, w)
	}
	cases := []struct {
		name      string
		off       uint16
		flags     uint16
		slots     int
		wantKick  bool
		wantAvail uint16
	}{
		{"enable", 0, EventFlagEnable, 1, true, 0},
		{"disable", 0, EventFlagDisable, 1, false, 1},
		// Event at the chain's own slot: crossed.
		{"desc-at-head", OffWrap(1, false), EventFlagDesc, 1, true, 2},
		// Event one past the chain: not yet.
		{"desc-beyond", OffWrap(4, false), EventFlagDesc, 2, false, 4},
		// Chain 4, 5, 6, 0: the event at 6 of the old lap (wrap 0
		// against the driver's 1 after the flip) is crossed.
		{"desc-previous-lap", OffWrap(6, false), EventFlagDesc, 4, true, 1},
		// Event at 2 of the driver's current lap: ahead.
		{"desc-ahead", OffWrap(2, true), EventFlagDesc, 1, false, 2},
	}
	for _, tc := range cases {
		drain()
		setDev(tc.off, tc.flags)
		add(tc.slots)
		before := q.Stats().Kicks
		kicked, err := q.Notify()
		if err != nil {
			t.Fatal(err)
		}
		if kicked != tc.wantKick || q.Stats().Kicks-before != b2i(tc.wantKick) {
			t.Errorf("%s: kicked %v, want %v", tc.name, kicked, tc.wantKick)
		}
		if i, _ := q.NextAvail(); i != tc.wantAvail {
			t.Fatalf("%s: next avail %d, want %d (the cases build on each other)", tc.name, i, tc.wantAvail)
		}
	}
}

// TestPackedInterruptSuppression: with EVENT_IDX the driver asks for an
// interrupt at its next used slot after each harvest; without it, it
// leaves the area at ENABLE; SetDriverEvent hands the area to the test, and
// a device that honours DISABLE leaves a chain to time out with a
// missed-notification error.
func TestPackedInterruptSuppression(t *testing.T) {
	for _, eventIdx := range []bool{true, false} {
		d, q := newPackedDevice(t, 100, eventIdx)
		d.run()
		// 275 chains of 4 slots: 11 laps, so the wrap counters end at 0.
		for i := range 275 {
			fc, err := q.SubmitFuse(FuseRequest{In: getattrReq(uint64(i)), OutArgs: 8, Indirect: IndirectNever})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := fc.Wait(5 * time.Second); err != nil {
				t.Fatalf("eventIdx=%v: %v", eventIdx, err)
			}
		}
		// NextUsed first: it waits for the interrupt handler's harvest,
		// which may still be writing the event area after it completed
		// the last chain.
		idx, wrap := q.NextUsed()
		off, flags := q.DriverEvent()
		if eventIdx && (flags != EventFlagDesc || off != OffWrap(idx, wrap)) {
			t.Errorf("EVENT_IDX: driver event %#x flags %d, want %#x flags DESC", off, flags, OffWrap(idx, wrap))
		}
		if !eventIdx && (flags != EventFlagEnable || off != 0) {
			t.Errorf("no EVENT_IDX: driver event %#x flags %d, want ENABLE", off, flags)
		}
		if wrap {
			t.Errorf("after 1100 slots in a ring of 100 the used wrap counter is 1")
		}
		q.SetDriverEvent(0, EventFlagDisable)
		fc, err := q.SubmitFuse(FuseRequest{In: getattrReq(1), OutArgs: 8})
		if err != nil {
			t.Fatal(err)
		}
		// Long enough for the device to have returned it on a loaded
		// machine: then the timeout is a missed notification.
		_, err = fc.Wait(time.Second)
		if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "missing call notification") {
			t.Fatalf("eventIdx=%v: got %v, want a missed-notification timeout", eventIdx, err)
		}
		if got := q.Harvest(); len(got) != 1 {
			t.Fatalf("harvest: %v", got)
		}
		if _, f := q.DriverEvent(); f != EventFlagDisable {
			t.Fatalf("the driver rewrote a pinned driver event area (flags %d)", f)
		}
		d.halt()
		if v := q.Violations(); len(v) != 0 {
			t.Fatal(v)
		}
	}
}

// TestPackedViolations: an id that is not in flight, and a used length
// beyond the writable bytes, are recorded; after the first the driver can
// no longer follow the ring, and says so when a chain times out, as it
// says where a device whose used index is out of step wrote.
func TestPackedViolations(t *testing.T) {
	d, q := newPackedDevice(t, 8, false)
	fc, err := q.AddFuse(FuseRequest{In: getattrReq(1), OutArgs: 8, Indirect: IndirectNever})
	if err != nil {
		t.Fatal(err)
	}
	c, ok := d.pop()
	if !ok {
		t.Fatal(d.err)
	}
	extra, _ := q.mem.AllocIn(1, 100, 8)
	c.write = append(c.write, Segment{extra, 100, true}) // more than the chain had
	d.complete(c)
	q.Interrupt()
	if _, err := fc.Wait(time.Second); !errors.Is(err, ErrUsedLen) {
		t.Fatalf("long used len: %v", err)
	}
	if v := q.Violations(); len(v) != 1 || !strings.Contains(v[0], "writable") {
		t.Fatalf("violations %q", v)
	}
	fc, err = q.AddFuse(FuseRequest{In: getattrReq(2), OutArgs: 8})
	if err != nil {
		t.Fatal(err)
	}
	c, _ = d.pop()
	c.id += 3 // not in flight
	d.complete(c)
	q.Interrupt()
	_, err = fc.Wait(100 * time.Millisecond)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "not in flight") {
		t.Fatalf("unknown id: %v", err)
	}
	if v := q.Violations(); len(v) != 2 {
		t.Fatalf("violations %q", v)
	}
	// fresh resets the ring on both sides and adds n requests.
	fresh := func(n int) []*FuseCall {
		t.Helper()
		if err := q.Reset(false); err != nil {
			t.Fatal(err)
		}
		d.at(ParsePackedBase(PackedResetBase))
		var calls []*FuseCall
		for i := range n {
			fc, err := q.AddFuse(FuseRequest{In: getattrReq(uint64(i)), OutArgs: 8, Indirect: IndirectNever})
			if err != nil {
				t.Fatal(err)
			}
			calls = append(calls, fc)
		}
		return calls
	}
	// A device that moves its used index by one slot too few or too
	// many: its next used descriptor lands where the driver expects none.
	for _, skew := range []int{-1, +1} {
		calls := fresh(2)
		c, _ = d.pop()
		c.slots += skew
		d.complete(c)
		c, _ = d.pop()
		d.complete(c)
		q.Interrupt()
		if _, err := calls[0].Wait(time.Second); err != nil {
			t.Fatal(err)
		}
		_, err = calls[1].Wait(100 * time.Millisecond)
		if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "out of step") {
			t.Fatalf("used index %+d slots out of step: %v", skew, err)
		}
		t.Log(err)
	}
	// Reset brings the driver back in step.
	calls := fresh(1)
	d.serve()
	q.Interrupt()
	if _, err := calls[0].Wait(time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestPackedConcurrent is TestLoopbackConcurrent on packed rings whose
// size is not a power of 2, with more requests than slots, in order and
// out of order.
func TestPackedConcurrent(t *testing.T) {
	for _, size := range []uint16{7, 100} {
		for _, eventIdx := range []bool{true, false} {
			for _, reverse := range []bool{false, true} {
				name := fmt.Sprintf("size=%d/eventIdx=%v/reverse=%v", size, eventIdx, reverse)
				d, q := newPackedDevice(t, size, eventIdx)
				d.reverse = reverse
				d.run()
				const workers, per = 3, 150
				var wg sync.WaitGroup
				errs := make(chan error, workers)
				for w := range workers {
					wg.Go(func() {
						for i := range per {
							r := FuseRequest{In: getattrReq(uint64(w*per + i)), OutArgs: 24, OutPages: 100 * (i % 3)}
							if i%2 == 0 {
								r.Indirect = IndirectNever // 4 or 5 slots
							}
							var fc *FuseCall
							var err error
							for deadline := time.Now().Add(5 * time.Second); ; {
								fc, err = q.SubmitFuse(r)
								if !errors.Is(err, ErrRingFull) || time.Now().After(deadline) {
									break
								}
								time.Sleep(time.Millisecond)
							}
							if err != nil {
								errs <- err
								return
							}
							b, err := fc.Wait(5 * time.Second)
							if err == nil {
								err = checkReply(b, r.OutArgs, r.OutPages)
							}
							if err != nil {
								errs <- fmt.Errorf("request %d of worker %d: %w", i, w, err)
								return
							}
						}
					})
				}
				wg.Wait()
				d.halt()
				close(errs)
				for err := range errs {
					t.Fatalf("%s: %v", name, err)
				}
				if d.err != nil {
					t.Fatalf("%s: device: %v", name, d.err)
				}
				if v := q.Violations(); len(v) != 0 {
					t.Fatalf("%s: %v", name, v)
				}
				if q.NumFree() != int(size) || q.InFlight() != 0 {
					t.Fatalf("%s: free %d in flight %d", name, q.NumFree(), q.InFlight())
				}
				if b := q.IdleBase(); b != d.base().Uint32() {
					t.Fatalf("%s: driver idle at %v, device at %v", name, ParsePackedBase(b), d.base())
				}
				st := q.Stats()
				t.Logf("%s: %d requests, %+v, %d chains wrapped, %d returned out of order, %d signals",
					name, workers*per, st, d.wrapped, d.outOfOrder, d.signals)
				if d.wrapped == 0 {
					t.Errorf("%s: no chain wrapped from the last slot to slot 0", name)
				}
				if eventIdx && st.Kicks >= workers*per {
					t.Errorf("%s: EVENT_IDX did not suppress any kick: %+v", name, st)
				}
			}
		}
	}
}

// skip walks the chain at the device's next avail slot by its flags alone,
// as a device rejecting it must (to know how far its used index moves),
// and takes it out of the ring without reading its buffers.
func (d *packedDevice) skip() (*poppedChain, bool) {
	if _, flags := loadTail(d.desc, d.availIdx); !IsAvail(flags, d.availWrap) {
		return nil, false
	}
	c := &poppedChain{}
	slot, wrap := d.availIdx, d.availWrap
	for {
		desc := readPackedDesc(d.desc, slot)
		if !IsAvail(desc.Flags, wrap) || c.slots == int(d.size) {
			return nil, false
		}
		c.slots++
		c.id = desc.ID
		slot, wrap = advance(slot, wrap, 1, d.size)
		if desc.Flags&DescNext == 0 {
			break
		}
	}
	d.availIdx, d.availWrap = slot, wrap
	return c, true
}

// TestPackedMalformed checks what AddMalformed puts in a packed ring for
// each kind, that a device walking it finds the fault, and that the driver
// stays in step when a device answers as Reaction says: a chain returned
// with len 0 (by a device that skipped its slots) leaves the ring serving.
func TestPackedMalformed(t *testing.T) {
	const size = 16
	getattr := FuseRequest{In: getattrReq(1), OutArgs: 8, Indirect: IndirectNever} // 2 readable + 2 writable
	for _, kind := range PackedMalformations() {
		t.Run(kind.String(), func(t *testing.T) {
			d, q := newPackedDevice(t, size, true)
			// Start mid-ring so that chains wrap.
			for range 3 {
				fc, err := q.AddFuse(getattr)
				if err != nil {
					t.Fatal(err)
				}
				d.serve()
				q.Interrupt()
				if _, err := fc.Wait(time.Second); err != nil {
					t.Fatal(err)
				}
			}
			head, wrap := q.NextAvail()
			r := getattr
			if kind == BadDuplicateID {
				r.Indirect = IndirectAuto
			}
			ch, err := q.AddMalformed(kind, r)
			if err != nil {
				t.Fatal(err)
			}
			desc := func(i int) PackedDesc {
				slot, w := advance(head, wrap, i, size)
				d := q.ReadPackedDesc(slot)
				if i < size && !IsAvail(d.Flags, w) && kind != BadChainUnterminated {
					t.Fatalf("descriptor %d of the chain (slot %d) is not available: %#x", i, slot, d.Flags)
				}
				if uint32(d.ID) != ch.Head {
					t.Fatalf("descriptor %d has id %d, the chain %d", i, d.ID, ch.Head)
				}
				d.Flags &^= DescAvail | DescUsed
				return d
			}
			slots := 4
			switch kind {
			case BadAddrOutside:
				if desc(0).Addr != q.mem.Unmapped() {
					t.Fatalf("head %+v", desc(0))
				}
			case BadAddrOverflow:
				if desc(0).Addr != ^uint64(0)-7 {
					t.Fatalf("head %+v", desc(0))
				}
			case BadZeroLength:
				if desc(0).Len != 0 {
					t.Fatalf("head %+v", desc(0))
				}
			case BadReadAfterWrite:
				if desc(1).Flags != DescNext|DescWrite || desc(2).Flags != DescNext {
					t.Fatalf("descriptors 1 and 2: %+v %+v", desc(1), desc(2))
				}
			case BadIndirectLenZero, BadIndirectLenOdd, BadIndirectHuge, BadIndirectOutside, BadIndirectTooLong:
				slots = 1
				h := desc(0)
				if h.Flags != DescIndirect {
					t.Fatalf("head %+v", h)
				}
				want := map[Malformation]bool{BadIndirectLenZero: h.Len == 0, BadIndirectLenOdd: h.Len == 4*DescSize+8,
					BadIndirectHuge: h.Len == 0xfffffff0, BadIndirectOutside: q.mem.Region(h.Addr) == nil,
					BadIndirectTooLong: h.Len == (size+1)*DescSize}
				if !want[kind] {
					t.Fatalf("indirect descriptor %+v", h)
				}
				if kind == BadIndirectTooLong {
					table := make([]byte, h.Len)
					q.mem.ReadAt(table, h.Addr)
					for i := 0; i < len(table); i += DescSize {
						if le.Uint16(table[i+14:])&DescNext != 0 {
							t.Fatalf("table entry %d has NEXT", i/DescSize)
						}
					}
				}
			case BadIndirectNext:
				slots = 2
				if desc(0).Flags != DescIndirect|DescNext || desc(1).Flags != DescWrite {
					t.Fatalf("descriptors %+v %+v", desc(0), desc(1))
				}
			case BadDuplicateID:
				slots = 1
				o := ch.Original()
				if o == nil || o.Head != ch.Head || q.InFlight() != 2 || desc(0).Flags != DescIndirect || desc(1).Flags != DescIndirect {
					t.Fatalf("original %v, %d in flight, descriptors %+v %+v", o, q.InFlight(), desc(0), desc(1))
				}
			case BadChainTooLong:
				slots = size
				for i := range size {
					if desc(i).Flags != DescNext {
						t.Fatalf("descriptor %d: %+v", i, desc(i))
					}
				}
				if q.NumFree() != 0 {
					t.Fatalf("%d slots free", q.NumFree())
				}
			case BadChainUnterminated:
				slots = 5
				if desc(3).Flags != DescNext|DescWrite {
					t.Fatalf("last descriptor %+v", desc(3))
				}
				slot, w := advance(head, wrap, 4, size)
				if f := q.ReadPackedDesc(slot).Flags; IsAvail(f, w) {
					t.Fatalf("the slot after the chain is available: %#x", f)
				}
			}
			if kind.Reaction() == RingBroken {
				if _, ok := d.pop(); ok || d.err == nil {
					t.Fatalf("the device found nothing wrong (%v)", d.err)
				}
				t.Logf("device: %v", d.err)
				return
			}
			// A device that rejects the chain and one that serves the
			// original of a duplicate.
			var orig *poppedChain
			if kind == BadDuplicateID {
				var ok bool
				if orig, ok = d.pop(); !ok {
					t.Fatal(d.err)
				}
			}
			bad, ok := d.skip()
			if !ok || bad.slots != slots {
				t.Fatalf("device walked %+v, want %d slots", bad, slots)
			}
			bad.write = nil
			d.complete(bad)
			if orig != nil {
				d.complete(orig)
			}
			d.notify()
			if n, err := ch.Wait(time.Second); err != nil || n != 0 {
				t.Fatalf("malformed chain: used len %d, %v", n, err)
			}
			if orig != nil {
				b, err := ch.Original().Wait(time.Second)
				if err == nil {
					err = checkReply(b, 8, 0)
				}
				if err != nil {
					t.Fatalf("original: %v", err)
				}
			}
			// The ring goes on.
			for i := range 2 * size {
				fc, err := q.SubmitFuse(getattr)
				if err != nil {
					t.Fatal(err)
				}
				d.serve()
				if _, err := fc.Wait(time.Second); err != nil {
					t.Fatalf("request %d after the malformed chain: %v", i, err)
				}
			}
			if v := q.Violations(); len(v) != 0 {
				t.Fatal(v)
			}
		})
	}
}

// TestMalformedLayouts: each layout refuses the other's kinds, and
// BadIndirectOutside works on split rings too.
func TestMalformedLayouts(t *testing.T) {
	_, pq := newPackedDevice(t, 16, true)
	mem, err := NewMemory(SplitLayout(4*MiB, 4*MiB))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	sq, err := NewQueue(mem, 1, QueueConfig{Size: 16, Indirect: true, BufRegion: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer sq.Close()
	r := FuseRequest{In: getattrReq(1), OutArgs: 8}
	for _, kind := range []Malformation{BadLoop, BadNextOutOfRange, BadHeadOutOfRange, BadIndirectNested, BadAvailJump} {
		if _, err := pq.AddMalformed(kind, r); err == nil {
			t.Errorf("%v on a packed ring", kind)
		}
	}
	for _, kind := range []Malformation{BadDuplicateID, BadChainTooLong, BadChainUnterminated} {
		if _, err := sq.AddMalformed(kind, r); err == nil {
			t.Errorf("%v on a split ring", kind)
		}
	}
	ch, err := sq.AddMalformed(BadIndirectOutside, r)
	if err != nil {
		t.Fatal(err)
	}
	if h := sq.ReadDesc(uint16(ch.Head)); h.Flags != DescIndirect || sq.mem.Region(h.Addr) != nil {
		t.Fatalf("split indirect descriptor %+v", h)
	}
	if len(Malformations()) != int(BadAvailJump)+1 || slices.Contains(Malformations(), BadIndirectOutside) {
		t.Fatalf("the split list changed: %v", Malformations())
	}
}
