package virtqueue

import (
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
)

// pdesc is a packed descriptor as the test driver means it: flags hold
// NEXT, WRITE and INDIRECT; the driver adds AVAIL and USED.
type pdesc struct {
	addr  uint64
	len   uint32
	flags uint16
}

func (d pdesc) bytes(id, flags uint16) []byte {
	var b [descSize]byte
	binary.LittleEndian.PutUint64(b[0:], d.addr)
	binary.LittleEndian.PutUint32(b[8:], d.len)
	binary.LittleEndian.PutUint16(b[12:], id)
	binary.LittleEndian.PutUint16(b[14:], flags)
	return b[:]
}

// pring is the driver side of a packed ring in the test guest, written
// from the spec (virtio 1.2 §2.8), not from packed.go: the descriptor ring
// at ringDesc, the driver event area at ringAvail, the device event area
// at ringUsed.
type pring struct {
	g                  *guest
	size               uint16
	next               uint16 // next slot to fill
	wrap               bool   // driver's avail wrap counter
	nextUsed           uint16 // next slot to read a used descriptor at
	usedWrap           bool
	slots              map[uint16]int // slots per id in flight
	eventIdx, indirect bool
}

func newPring(g *guest, size uint16) *pring {
	r := &pring{g: g, size: size, wrap: true, usedWrap: true, slots: map[uint16]int{}}
	g.write(ringDesc, make([]byte, descSize*int(size)))
	g.write(ringAvail, make([]byte, 4))
	g.write(ringUsed, make([]byte, 4))
	return r
}

func (r *pring) base() uint32 {
	b := uint32(r.next) | uint32(r.nextUsed)<<16
	if r.wrap {
		b |= 1 << 15
	}
	if r.usedWrap {
		b |= 1 << 31
	}
	return b
}

func (r *pring) config() Config {
	return Config{
		Size: r.size, Packed: true,
		DescAddr: r.g.uva(ringDesc), AvailAddr: r.g.uva(ringAvail), UsedAddr: r.g.uva(ringUsed),
		Base: r.base(), EventIdx: r.eventIdx, Indirect: r.indirect,
	}
}

func (r *pring) open(t testing.TB) *Queue {
	t.Helper()
	return openQueue(t, r.config(), r.g.mem)
}

// availFlags are the AVAIL/USED bits that make a slot available under
// driver wrap counter w.
func availFlags(w bool) uint16 {
	if w {
		return packedAvail
	}
	return packedUsed
}

// add makes the chain ds available under id, with NEXT on every
// descriptor but the last: every descriptor but the first, then the first
// (as Linux does, the head's flags last). It returns the slots used.
func (r *pring) add(id uint16, ds ...pdesc) int {
	ds = append([]pdesc(nil), ds...)
	for i := range ds {
		ds[i].flags &^= descNext
		if i < len(ds)-1 {
			ds[i].flags |= descNext
		}
	}
	return r.addRaw(id, ds...)
}

// addRaw is add with the flags as given.
func (r *pring) addRaw(id uint16, ds ...pdesc) int {
	headSlot, headWrap := r.next, r.wrap
	for i, d := range ds {
		if i > 0 {
			r.g.write(ringDesc+uint64(r.next)*descSize, d.bytes(id, d.flags|availFlags(r.wrap)))
		}
		if r.next++; r.next == r.size {
			r.next, r.wrap = 0, !r.wrap
		}
	}
	r.g.write(ringDesc+uint64(headSlot)*descSize, ds[0].bytes(id, ds[0].flags|availFlags(headWrap)))
	r.slots[id] = len(ds)
	return len(ds)
}

// used reads the used descriptor at the driver's next used slot, if there
// is one, and advances past the chain its id names.
func (r *pring) used(t testing.TB) (id uint16, n uint32, flags uint16, ok bool) {
	t.Helper()
	b := r.g.host(ringDesc+uint64(r.nextUsed)*descSize, descSize)
	flags = binary.LittleEndian.Uint16(b[14:])
	isUsed := flags&packedAvail != 0 == r.usedWrap && flags&packedUsed != 0 == r.usedWrap
	if !isUsed {
		return 0, 0, 0, false
	}
	id, n = binary.LittleEndian.Uint16(b[12:]), binary.LittleEndian.Uint32(b[8:])
	slots, ok := r.slots[id]
	if !ok {
		t.Fatalf("used descriptor at slot %d names id %d, not in flight", r.nextUsed, id)
	}
	delete(r.slots, id)
	for range slots {
		if r.nextUsed++; r.nextUsed == r.size {
			r.nextUsed, r.usedWrap = 0, !r.usedWrap
		}
	}
	return id, n, flags, true
}

func (r *pring) setDriverEvent(offWrap, flags uint16) {
	var b [4]byte
	binary.LittleEndian.PutUint16(b[0:], offWrap)
	binary.LittleEndian.PutUint16(b[2:], flags)
	r.g.write(ringAvail, b[:])
}

func (r *pring) deviceEvent() (offWrap, flags uint16) {
	b := r.g.host(ringUsed, 4)
	return binary.LittleEndian.Uint16(b), binary.LittleEndian.Uint16(b[2:])
}

// request is a three-buffer FUSE-like chain: 40 readable bytes, a 16-byte
// and a len-byte writable buffer, at distinct places per id.
func request(id uint16, n uint32) []pdesc {
	base := dataGPA + uint64(id%64)*0x1000
	return []pdesc{
		{base, 40, descNext},
		{base + 0x100, 16, descNext | descWrite},
		{base + 0x200, n, descWrite},
	}
}

func popOne(t testing.TB, q *Queue, c *DescChain, mem *GuestMemory) {
	t.Helper()
	ok, err := q.Pop(c, mem)
	if !ok || err != nil {
		t.Fatalf("Pop: %v, %v", ok, err)
	}
}

// TestPackedRoundTrip runs several laps of a ring whose size is not a power
// of two, with chains of 1 to 3 slots, so chains wrap from the last slot
// to slot 0; each reply's used descriptor must carry the chain's id, its
// length and WRITE, under the device's wrap counter, and the ring's base
// must track both indices and wrap counters.
func TestPackedRoundTrip(t *testing.T) {
	for _, size := range []uint16{1, 3, 7, 100, 256} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			g := newGuest(t)
			r := newPring(g, size)
			q := r.open(t)
			c := NewDescChain(size)
			for i := range 3*int(size) + 5 {
				id := uint16(1000 + i)
				chain := request(id, 64)[:1+i%min(3, int(size))]
				r.add(id, chain...)
				if q.Waiting(10) != 1 || !q.Pending() {
					t.Fatalf("round %d: waiting %d", i, q.Waiting(10))
				}
				popOne(t, q, c, g.mem)
				if c.ID() != id || len(c.Readable.Segments()) != 1 || len(c.Writable.Segments()) != len(chain)-1 {
					t.Fatalf("round %d: id %d, %d+%d segments", i, c.ID(), len(c.Readable.Segments()), len(c.Writable.Segments()))
				}
				q.Push(c.Token, uint32(i))
				gotID, n, flags, ok := r.used(t)
				if !ok || gotID != id || n != uint32(i) || (flags&descWrite != 0) != (i > 0) {
					t.Fatalf("round %d: used %v id %d len %d flags %#x", i, ok, gotID, n, flags)
				}
				if q.Base() != r.base() {
					t.Fatalf("round %d: base %#x, driver %#x", i, q.Base(), r.base())
				}
			}
			if ok, err := q.Pop(c, g.mem); ok || err != nil {
				t.Fatalf("Pop on an empty ring: %v %v", ok, err)
			}
		})
	}
}

// TestPackedOutOfOrder completes chains in another order than they were
// popped: each used descriptor lands at the device's used index, and the
// driver, advancing by each id's slots, stays in step.
func TestPackedOutOfOrder(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 8)
	q := r.open(t)
	cs := []*DescChain{NewDescChain(8), NewDescChain(8), NewDescChain(8)}
	for lap := range 10 {
		for k := range cs {
			r.add(uint16(k+10*lap), request(uint16(k), 8)[:k+1]...)
		}
		if w := q.Waiting(10); w != 3 {
			t.Fatalf("lap %d: waiting %d, want 3", lap, w)
		}
		for _, c := range cs {
			popOne(t, q, c, g.mem)
		}
		for k := len(cs) - 1; k >= 0; k-- {
			q.Push(cs[k].Token, 8)
			id, _, _, ok := r.used(t)
			if !ok || id != uint16(k+10*lap) {
				t.Fatalf("lap %d: used %v id %d, want %d", lap, ok, id, k+10*lap)
			}
		}
		if q.Base() != r.base() {
			t.Fatalf("lap %d: base %#x, driver %#x", lap, q.Base(), r.base())
		}
	}
}

// TestPackedIndirect pops a chain of one indirect descriptor (one slot),
// with NEXT and INDIRECT inside the table ignored as reserved.
func TestPackedIndirect(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 4)
	r.indirect = true
	q := r.open(t)
	c := NewDescChain(4)
	var table []byte
	for i, d := range request(1, 100) {
		table = append(table, d.bytes(0, d.flags|descIndirect*uint16(i&1))...)
	}
	g.write(tablesGPA, table)
	for i := range 9 { // wraps twice
		r.add(uint16(i), pdesc{tablesGPA, uint32(len(table)), descIndirect})
		popOne(t, q, c, g.mem)
		if c.Readable.Len() != 40 || c.Writable.Len() != 116 {
			t.Fatalf("%d: readable %d writable %d", i, c.Readable.Len(), c.Writable.Len())
		}
		q.Push(c.Token, 116)
		if id, n, _, ok := r.used(t); !ok || id != uint16(i) || n != 116 {
			t.Fatalf("%d: used %v %d %d", i, ok, id, n)
		}
	}
}

// TestPackedBadChains returns each malformed chain whose extent is known
// with len 0, its id and its slot count, and goes on serving.
func TestPackedBadChains(t *testing.T) {
	const outside = 0x3000_0000 // between regions C and D
	tests := []struct {
		name     string
		indirect bool
		chain    []pdesc
		table    []pdesc // written at tablesGPA
	}{
		{"address outside memory", false, []pdesc{{dataGPA, 40, descNext}, {outside, 16, descWrite}}, nil},
		{"buffer wraps", false, []pdesc{{^uint64(0) - 8, 40, 0}}, nil},
		{"readable after writable", false, []pdesc{{dataGPA, 16, descNext | descWrite}, {dataGPA + 0x100, 40, 0}}, nil},
		{"indirect not negotiated", false, []pdesc{{tablesGPA, 32, descIndirect}}, []pdesc{{dataGPA, 40, 0}, {dataGPA + 0x100, 16, descWrite}}},
		{"indirect with next", true, []pdesc{{tablesGPA, 32, descIndirect}, {dataGPA, 16, descWrite}}, []pdesc{{dataGPA, 40, 0}, {dataGPA + 0x100, 16, descWrite}}},
		{"indirect after direct", true, []pdesc{{dataGPA, 40, descNext}, {tablesGPA, 32, descIndirect}}, []pdesc{{dataGPA, 40, 0}, {dataGPA + 0x100, 16, descWrite}}},
		{"indirect length 0", true, []pdesc{{tablesGPA, 0, descIndirect}}, nil},
		{"indirect length 24", true, []pdesc{{tablesGPA, 24, descIndirect}}, nil},
		{"indirect beyond ring size", true, []pdesc{{tablesGPA, 16 * 9, descIndirect}}, nil},
		{"indirect table outside memory", true, []pdesc{{outside, 32, descIndirect}}, nil},
		{"indirect table misaligned", true, []pdesc{{tablesGPA + 8, 32, descIndirect}}, nil},
		{"indirect buffer outside memory", true, []pdesc{{tablesGPA, 32, descIndirect}}, []pdesc{{dataGPA, 40, 0}, {outside, 16, descWrite}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := newGuest(t)
			r := newPring(g, 8)
			r.indirect = tc.indirect
			q := r.open(t)
			c := NewDescChain(8)
			var table []byte
			for _, d := range tc.table {
				table = append(table, d.bytes(0, d.flags)...)
			}
			g.write(tablesGPA, table)
			for i := range 12 { // laps with a bad chain among good ones
				id := uint16(7 * i)
				bad := i%3 == 1
				if bad {
					r.add(id, tc.chain...)
				} else {
					r.add(id, request(id, 8)...)
				}
				ok, err := q.Pop(c, g.mem)
				if !ok || bad != errors.Is(err, ErrBadChain) || (!bad && err != nil) {
					t.Fatalf("%d: Pop %v, %v (bad %v)", i, ok, err, bad)
				}
				n := uint32(8)
				if bad {
					n = 0
				}
				q.Push(c.Token, n)
				gotID, gotN, flags, ok := r.used(t)
				if !ok || gotID != id || gotN != n || (flags&descWrite != 0) != !bad {
					t.Fatalf("%d: used %v id %d len %d flags %#x", i, ok, gotID, gotN, flags)
				}
				if q.Broken() || q.Base() != r.base() {
					t.Fatalf("%d: broken %v, base %#x, driver %#x", i, q.Broken(), q.Base(), r.base())
				}
			}
		})
	}
}

// TestPackedIDInFlight refuses a chain reusing the id of one in flight,
// returns it with len 0, and still completes the first chain; once that
// is done the id may be used again.
func TestPackedIDInFlight(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 8)
	q := r.open(t)
	c1, c2 := NewDescChain(8), NewDescChain(8)
	r.add(5, request(5, 8)...)
	popOne(t, q, c1, g.mem)
	// The driver reuses id 5 (the test driver's own bookkeeping keeps
	// the slots of the latest; both chains take 3).
	r.add(5, request(5, 8)...)
	if ok, err := q.Pop(c2, g.mem); !ok || !errors.Is(err, ErrBadChain) {
		t.Fatalf("second chain with id 5: %v, %v", ok, err)
	}
	q.Push(c2.Token, 0)
	r.slots[5] = 3
	if id, n, _, ok := r.used(t); !ok || id != 5 || n != 0 {
		t.Fatalf("refused chain: used %v id %d len %d", ok, id, n)
	}
	r.slots[5] = 3
	q.Push(c1.Token, 8)
	if id, n, _, ok := r.used(t); !ok || id != 5 || n != 8 {
		t.Fatalf("first chain: used %v id %d len %d", ok, id, n)
	}
	r.add(5, request(5, 8)...)
	popOne(t, q, c1, g.mem)
	q.Push(c1.Token, 8)
	if id, _, _, ok := r.used(t); !ok || id != 5 || q.Base() != r.base() {
		t.Fatalf("id 5 again: used %v id %d; base %#x, driver %#x", ok, id, q.Base(), r.base())
	}
}

// TestPackedBroken: a chain whose end cannot be found breaks the ring,
// which then pops nothing until it is set up again.
func TestPackedBroken(t *testing.T) {
	t.Run("longer than the ring", func(t *testing.T) {
		g := newGuest(t)
		r := newPring(g, 4)
		q := r.open(t)
		r.addRaw(1, pdesc{dataGPA, 8, descNext}, pdesc{dataGPA, 8, descNext}, pdesc{dataGPA, 8, descNext}, pdesc{dataGPA, 8, descNext})
		c := NewDescChain(4)
		if ok, err := q.Pop(c, g.mem); ok || !errors.Is(err, ErrBroken) || !q.Broken() {
			t.Fatalf("Pop: %v, %v, broken %v", ok, err, q.Broken())
		}
		if q.Pending() || q.Waiting(5) != 0 || c.Readable.Len() != 0 {
			t.Fatal("a broken ring still offers chains")
		}
	})
	t.Run("runs into a slot not available", func(t *testing.T) {
		g := newGuest(t)
		r := newPring(g, 8)
		q := r.open(t)
		// Only the head is made available: its NEXT points at slot 1,
		// which the driver never wrote.
		g.write(ringDesc, pdesc{dataGPA, 8, descNext}.bytes(1, descNext|availFlags(true)))
		c := NewDescChain(8)
		if ok, err := q.Pop(c, g.mem); ok || !errors.Is(err, ErrBroken) || !q.Broken() {
			t.Fatalf("Pop: %v, %v", ok, err)
		}
	})
	t.Run("slot of the previous lap", func(t *testing.T) {
		// After a lap, a chain continuing into a slot still marked with
		// the old wrap counter is not available either.
		g := newGuest(t)
		r := newPring(g, 2)
		q := r.open(t)
		c := NewDescChain(2)
		r.add(1, pdesc{dataGPA, 8, 0})
		popOne(t, q, c, g.mem)
		q.Push(c.Token, 0)
		r.used(t)
		r.addRaw(2, pdesc{dataGPA, 8, descNext}) // slot 1; NEXT into slot 0 (old lap, and used)
		if ok, err := q.Pop(c, g.mem); ok || !errors.Is(err, ErrBroken) {
			t.Fatalf("Pop: %v, %v", ok, err)
		}
	})
}

// TestPackedBase: a ring set up again from another's Base continues
// exactly, including at every wrap counter combination, and a base with an
// index beyond the ring is refused.
func TestPackedBase(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 5)
	c := NewDescChain(5)
	for cycle := range 1000 {
		q, err := New(r.config(), g.mem)
		if err != nil {
			t.Fatal(cycle, err)
		}
		for k := range cycle % 4 {
			id := uint16(cycle*4 + k)
			r.add(id, request(id, 8)[:1+k%3]...)
			popOne(t, q, c, g.mem)
			q.Push(c.Token, 8)
			if got, _, _, ok := r.used(t); !ok || got != id {
				t.Fatalf("cycle %d: used %v id %d, want %d", cycle, ok, got, id)
			}
		}
		if q.Base() != r.base() {
			t.Fatalf("cycle %d: base %#x, driver %#x", cycle, q.Base(), r.base())
		}
		q.Close()
	}
	cfg := r.config()
	for _, base := range []uint32{5, 5 << 16, 0x7fff} {
		cfg.Base = base
		if q, err := New(cfg, g.mem); err == nil {
			q.Close()
			t.Errorf("base %#x accepted on a ring of 5", base)
		}
	}
}

// TestPackedEventSuppression checks both directions: the device event area
// the device writes (kicks), and the interrupt decision from the driver
// event area.
func TestPackedEventSuppression(t *testing.T) {
	for _, eventIdx := range []bool{false, true} {
		t.Run(fmt.Sprint("event_idx=", eventIdx), func(t *testing.T) {
			g := newGuest(t)
			r := newPring(g, 4)
			r.eventIdx = eventIdx
			q := r.open(t)
			count := signals(t, q)
			c := NewDescChain(4)
			// Kicks: after EnableNotify, the device area asks for a
			// kick at the next slot (EVENT_IDX) or for every one.
			if q.EnableNotify() {
				t.Fatal("EnableNotify on an empty ring reports chains")
			}
			wantEvent := func(when string) {
				t.Helper()
				off, flags := r.deviceEvent()
				if !eventIdx {
					if flags != eventEnable {
						t.Fatalf("%s: device event flags %d", when, flags)
					}
					return
				}
				if flags != eventDesc || uint32(off) != r.base()&0xffff {
					t.Fatalf("%s: device event %#x/%d, want %#x/2", when, off, flags, r.base()&0xffff)
				}
			}
			wantEvent("enabled")
			r.add(1, request(1, 8)...)
			if !q.EnableNotify() {
				t.Fatal("EnableNotify misses a chain made available")
			}
			popOne(t, q, c, g.mem)
			wantEvent("after pop") // slot 3, wrap 1

			// Interrupts.
			r.setDriverEvent(0, eventDisable)
			q.Push(c.Token, 8)
			r.used(t)
			if q.Notify(); count() != 0 {
				t.Fatal("signalled with interrupts disabled")
			}
			// serve takes a one-slot chain round and returns the signals
			// its Notify gave.
			serve := func(id uint16) uint64 {
				t.Helper()
				r.add(id, pdesc{dataGPA, 8, descWrite})
				popOne(t, q, c, g.mem)
				q.Push(c.Token, 8)
				r.used(t)
				q.Notify()
				return count()
			}
			r.setDriverEvent(0, eventEnable)
			for i := range 3 { // slots 3, 0 (wrap), 1
				if serve(uint16(10+i)) != 1 {
					t.Fatalf("enabled: no signal after push %d", i)
				}
			}
			if !eventIdx {
				return
			}
			// DESC: signal once the used index passes off_wrap. The
			// device's used index is now 2, wrap 0.
			evAt := func(slot uint16, wrap bool) uint16 {
				if wrap {
					return slot | 0x8000
				}
				return slot
			}
			r.setDriverEvent(evAt(3, false), eventDesc)
			for i, want := range []uint64{0, 1, 0, 0} { // uses slots 2, 3, 0 (wrap 1), 1
				if got := serve(uint16(20 + i)); got != want {
					t.Fatalf("desc event at 3/wrap 0, push %d: %d signals, want %d", i, got, want)
				}
			}
			// An event in the next lap (slot 0, wrap 0: the used index
			// is 2, wrap 1): crossed after pushes to slots 2, 3 and 0.
			r.setDriverEvent(evAt(0, false), eventDesc)
			for i, want := range []uint64{0, 0, 1} {
				if got := serve(uint16(30 + i)); got != want {
					t.Fatalf("desc event at 0/wrap 0, push %d: %d signals, want %d", i, got, want)
				}
			}
		})
	}
}

// TestPackedFirstDecisionSignals: a new ring does not know what the guest
// was told before it, so with EVENT_IDX its first decision signals.
func TestPackedFirstDecisionSignals(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 4)
	r.eventIdx = true
	q := r.open(t)
	count := signals(t, q)
	r.setDriverEvent(3, eventDesc) // far ahead
	c := NewDescChain(4)
	r.add(1, pdesc{dataGPA, 8, descWrite})
	popOne(t, q, c, g.mem)
	if err := q.PushNotify(c.Token, 8); err != nil || count() != 1 {
		t.Fatalf("first decision: %v, %d signals", err, count())
	}
}

// TestPackedDirtyLog: used descriptors are logged by the descriptor ring's
// guest address, the device event area by the address the front end gave.
func TestPackedDirtyLog(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 4)
	r.eventIdx = true
	var log DirtyLog
	bitmap := make([]byte, 8*((endC>>12)/64+1))
	log.Replace(bitmap, nil)
	log.SetActive(true)
	cfg := r.config()
	cfg.Log, cfg.LogUsed, cfg.UsedLogAddr = &log, true, ringUsed
	q, err := New(cfg, g.mem)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	dirty := func(gpa uint64) bool { p := gpa >> 12; return bitmap[p/8]&(1<<(p%8)) != 0 }
	c := NewDescChain(4)
	r.add(1, request(1, 8)...)
	popOne(t, q, c, g.mem)
	if !dirty(ringUsed) {
		t.Error("device event area write not logged")
	}
	if dirty(ringDesc) {
		t.Error("descriptor ring logged before any used descriptor")
	}
	q.Push(c.Token, 8)
	if !dirty(ringDesc) {
		t.Error("used descriptor not logged at the descriptor ring's address")
	}
}

// TestPackedAllocs: popping and pushing allocates nothing.
func TestPackedAllocs(t *testing.T) {
	g := newGuest(t)
	r := newPring(g, 64)
	r.indirect, r.eventIdx = true, true
	q := r.open(t)
	c := NewDescChain(64)
	var table []byte
	for _, d := range request(1, 4096) {
		table = append(table, d.bytes(0, d.flags)...)
	}
	g.write(tablesGPA, table)
	head := g.host(ringDesc, descSize*64)
	slot, wrap := 0, true
	allocs := testing.AllocsPerRun(1000, func() {
		copy(head[slot*descSize:], pdesc{tablesGPA, uint32(len(table)), descIndirect}.bytes(9, descIndirect|availFlags(wrap)))
		if slot++; slot == 64 {
			slot, wrap = 0, !wrap
		}
		if ok, err := q.Pop(c, g.mem); !ok || err != nil {
			t.Fatal(ok, err)
		}
		q.Push(c.Token, 4096)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per request", allocs)
	}
}

// Packed fuzz input layout (missing bytes read as zero):
//
//	[0]     features: bit 0 INDIRECT_DESC, bit 1 EVENT_IDX
//	[1]     ring size - 1, mod 64 (sizes 1..64, not only powers of two)
//	[2:6]   le32 ring base (both indices taken mod the size)
//	[6:10]  the driver event area
//	then    the descriptor ring (16*size bytes), and the rest: the table
//	        at fuzzTableGPA (its first 16 entries in region A, the rest in
//	        the GPA-adjacent region B).
func packedFuzzSeeds() [][]byte {
	seed := func(features, size byte, base uint32, ring []byte, table []byte) []byte {
		b := []byte{features, size - 1, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.LittleEndian.PutUint32(b[2:], base)
		ring = append(ring, make([]byte, 16*int(size)-len(ring))...)
		return append(append(b, ring...), table...)
	}
	av := availFlags(true)
	var direct, indirect, wrapped []byte
	for i, d := range request(3, 64) {
		f := d.flags | av
		if i == 2 {
			f &^= descNext
		}
		direct = append(direct, d.bytes(3, f)...)
	}
	indirect = pdesc{fuzzTableGPA, 48, descIndirect}.bytes(7, descIndirect|av)
	var table []byte
	for _, d := range request(0, 64) {
		table = append(table, d.bytes(0, d.flags)...)
	}
	// A chain from the last slot of a ring of 4 into slot 0 (wrap flips).
	wrapped = append(pdesc{dataGPA + 0x100, 16, descWrite}.bytes(9, descWrite|availFlags(false)), make([]byte, 32)...)
	wrapped = append(wrapped, pdesc{dataGPA, 40, descNext}.bytes(9, descNext|av)...)
	return [][]byte{
		seed(3, 8, 0x80008000, direct, nil),
		seed(1, 8, 0x80008000, indirect, table),
		seed(2, 4, 0x00038003|1<<15|1<<31, wrapped, nil),
		seed(0, 3, 0x80008000, append(direct[16:], direct[:16]...), nil),
	}
}

// FuzzPackedChainWalk lays fuzz bytes out as a packed ring and an indirect
// table, with fuzz-chosen features, size and base, and pops (pushing each
// chain back) until the ring is empty or broken. Pop must terminate, never
// panic, return only segments inside guest memory, report a bad chain with
// a slot count the ring can hold, and leave the ring's indices exact.
func FuzzPackedChainWalk(f *testing.F) {
	for _, s := range packedFuzzSeeds() {
		f.Add(s)
	}
	g := newGuest(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		in := newFuzzInput(data, 10)
		size := uint16(in.at(1)%64) + 1
		Q := int(size)
		raw := uint32(in.at(2)) | uint32(in.at(3))<<8 | uint32(in.at(4))<<16 | uint32(in.at(5))<<24
		availIdx, usedIdx := uint16(raw&0x7fff)%size, uint16(raw>>16&0x7fff)%size
		base := uint32(availIdx) | raw&(1<<15) | uint32(usedIdx)<<16 | raw&(1<<31)
		g.t = t
		g.write(ringDesc, make([]byte, 16*64))
		g.write(ringAvail, []byte{in.at(6), in.at(7), in.at(8), in.at(9)})
		g.write(ringUsed, make([]byte, 4))
		g.write(ringDesc, in.take(16*Q))
		table := in.take(min(len(in.rest), 16*64+16))
		g.write(fuzzTableGPA, table)
		defer g.write(fuzzTableGPA, make([]byte, len(table)))

		cfg := Config{Size: size, Packed: true, DescAddr: g.uva(ringDesc), AvailAddr: g.uva(ringAvail),
			UsedAddr: g.uva(ringUsed), Base: base, Indirect: in.at(0)&1 != 0, EventIdx: in.at(0)&2 != 0}
		q, err := New(cfg, g.mem)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		defer q.Close()
		c := NewDescChain(size)
		maxSegs := Q + regionSplits
		total := 0 // slots popped
		for pops := 0; ; pops++ {
			// Slots the driver made available under one wrap counter
			// are not under the other: at most two laps.
			if pops > 2*Q {
				t.Fatalf("Pop returned %d chains from a ring of %d", pops, Q)
			}
			ok, err := q.Pop(c, g.mem)
			if !ok {
				if err != nil && (!errors.Is(err, ErrBroken) || !q.Broken()) {
					t.Fatalf("Pop: not ok with %v", err)
				}
				break
			}
			if err != nil && !errors.Is(err, ErrBadChain) {
				t.Fatalf("Pop: unexpected error %v", err)
			}
			slots := int(uint16(c.Token >> 16))
			if slots < 1 || slots > Q || uint16(c.Token) != c.ID() {
				t.Fatalf("token %#x: %d slots on a ring of %d, id %d", uint64(c.Token), slots, Q, c.ID())
			}
			total += slots
			if err == nil {
				checkSegments(t, g, c, maxSegs)
			}
			q.Push(c.Token, 0)
			c.Release()
		}
		if err := q.Notify(); err != nil {
			t.Fatal(err)
		}
		// Both indices moved by the slots taken, each wrap counter
		// flipping at every lap.
		at := func(idx uint16, wrap bool) uint32 {
			n := int(idx) + total
			if (n/Q)%2 == 1 {
				wrap = !wrap
			}
			return packedBase(uint16(n%Q), wrap)
		}
		want := base
		if !q.Broken() {
			want = at(availIdx, raw&(1<<15) != 0) | at(usedIdx, raw&(1<<31) != 0)<<16
		} else {
			want = uint32(q.Base()&0xffff) | at(usedIdx, raw&(1<<31) != 0)<<16
		}
		if q.Base() != want {
			t.Fatalf("base %#x after %d slots from %#x, want %#x", q.Base(), total, base, want)
		}
	})
}
