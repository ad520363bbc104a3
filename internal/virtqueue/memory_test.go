package virtqueue

import (
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"
)

func sameBytes(a, b []byte) bool {
	if len(a) != len(b) {
		return false
	}
	return len(a) == 0 || unsafe.Pointer(&a[0]) == unsafe.Pointer(&b[0])
}

func TestNewRegion(t *testing.T) {
	m := NewMapping(make([]byte, 0x3000), nil)
	tests := []struct {
		name                string
		gpa, size, uva, off uint64
		ok                  bool
	}{
		{"whole mapping", 0x1000, 0x3000, 0x7000, 0, true},
		{"at an offset", 0x1000, 0x1000, 0x7000, 0x2000, true},
		{"size 0", 0x1000, 0, 0x7000, 0, false},
		{"beyond the mapping", 0x1000, 0x2001, 0x7000, 0x1000, false},
		{"offset beyond the mapping", 0x1000, 1, 0x7000, 0x3000, false},
		{"offset wraps", 0x1000, 0x1000, 0x7000, math.MaxUint64 - 0xfff, false},
		{"GPA wraps", math.MaxUint64 - 0xfff, 0x2000, 0x7000, 0, false},
		{"GPA ends at 2^64", math.MaxUint64 - 0xfff, 0x1000, 0x7000, 0, false},
		{"UVA wraps", 0x1000, 0x2000, math.MaxUint64 - 0xfff, 0, false},
	}
	for _, tc := range tests {
		r, err := NewRegion(tc.gpa, tc.size, tc.uva, tc.off, m)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v, want ok %v", tc.name, err, tc.ok)
			continue
		}
		if tc.ok {
			h := r.Host()
			if uint64(len(h)) != tc.size || uint64(cap(h)) != tc.size || !sameBytes(h[:1], m.Bytes()[tc.off:tc.off+1]) {
				t.Errorf("%s: host bytes are not mapping[%#x:+%#x]", tc.name, tc.off, tc.size)
			}
		}
	}
	a, _ := NewRegion(0x1000, 0x1000, 0x7000, 0, m)
	b, _ := NewRegion(0x1000, 0x1000, 0x7000, 0x1000, m)
	c, _ := NewRegion(0x1000, 0x1000, 0x8000, 0, m)
	if !a.SameAs(&b) || a.SameAs(&c) {
		t.Error("SameAs must compare GPA, size and UVA, not the mmap offset")
	}
}

func TestNewGuestMemoryOverlap(t *testing.T) {
	released := 0
	m := NewMapping(make([]byte, 0x10000), func([]byte) { released++ })
	reg := func(gpa, size, uva uint64) Region {
		r, err := NewRegion(gpa, size, uva, 0, m)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	tests := []struct {
		name    string
		regions []Region
		ok      bool
	}{
		{"empty", nil, true},
		{"adjacent", []Region{reg(0x2000, 0x1000, 0x10000), reg(0x1000, 0x1000, 0x20000)}, true},
		{"adjacent both ways", []Region{reg(0x1000, 0x1000, 0x10000), reg(0x2000, 0x1000, 0x11000)}, true},
		{"same mapping twice, disjoint", []Region{reg(0x1000, 0x1000, 0x10000), reg(0x9000, 0x1000, 0x30000)}, true},
		{"GPA overlap by one byte", []Region{reg(0x1000, 0x1001, 0x10000), reg(0x2000, 0x1000, 0x20000)}, false},
		{"GPA contained", []Region{reg(0x1000, 0x4000, 0x10000), reg(0x2000, 0x1000, 0x20000)}, false},
		{"GPA identical", []Region{reg(0x1000, 0x1000, 0x10000), reg(0x1000, 0x1000, 0x20000)}, false},
		{"UVA overlap", []Region{reg(0x1000, 0x1000, 0x10000), reg(0x5000, 0x1000, 0x10fff)}, false},
		{"UVA overlap, reverse order", []Region{reg(0x5000, 0x1000, 0x10000), reg(0x1000, 0x2000, 0xf000)}, false},
		{"third overlaps the first", []Region{reg(0x1000, 0x1000, 0x10000), reg(0x3000, 0x1000, 0x20000), reg(0x1800, 0x100, 0x30000)}, false},
	}
	for _, tc := range tests {
		g, err := NewGuestMemory(tc.regions)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v, want ok %v", tc.name, err, tc.ok)
		}
		if err == nil {
			if len(g.Regions()) != len(tc.regions) {
				t.Errorf("%s: %d regions", tc.name, len(g.Regions()))
			}
			for i := 1; i < len(g.Regions()); i++ {
				if g.Regions()[i-1].GuestPhysAddr >= g.Regions()[i].GuestPhysAddr {
					t.Errorf("%s: regions not sorted by GPA", tc.name)
				}
			}
			g.Put()
		}
	}
	// A refused table took no references: the mapping goes with its own.
	m.Put()
	if released != 1 {
		t.Fatalf("mapping released %d times, want 1", released)
	}
}

func TestNewGuestMemoryRejectsInvalidRegion(t *testing.T) {
	// A Region that NewRegion refused (or a zero Region) has no mapping.
	m := NewMapping(make([]byte, 0x1000), nil)
	bad, err := NewRegion(0, 0, 0, 0, m)
	if err == nil {
		t.Fatal("NewRegion accepted size 0")
	}
	for _, rs := range [][]Region{{bad}, {{}}} {
		if g, err := NewGuestMemory(rs); err == nil {
			g.Put()
			t.Error("NewGuestMemory accepted a region without a mapping")
		}
	}
}

func TestSliceNextUserSlice(t *testing.T) {
	g := newGuest(t)
	mem := g.mem
	type want int
	const (
		none want = iota // not translated
		full             // all n bytes, in one slice
	)
	slices := []struct {
		name   string
		gpa, n uint64
		want   want
	}{
		{"first byte", gpaA, 1, full},
		{"whole region", gpaC, sizeC, full},
		{"last byte of a region", endC - 1, 1, full},
		{"last byte plus one", endC - 1, 2, none},
		{"one past the end", endC, 1, none},
		{"zero length inside", gpaC + 5, 0, full},
		{"zero length at the start", gpaB, 0, full},
		{"zero length one past the end", endC, 0, none},
		{"zero length one past the last region", endD, 0, none},
		{"straddles adjacent A|B", gpaB - 1, 2, none},
		{"in the gap", 0x20000, 1, none},
		{"below a region", gpaD - 1, 1, none},
		{"last byte of the last region", endD - 1, 1, full},
		{"wraps: huge length", gpaC + 1, math.MaxUint64, none},
		{"wraps: top address", math.MaxUint64, 2, none},
		{"length 2^64-1 from 0", 0, math.MaxUint64, none},
	}
	for _, tc := range slices {
		b, ok := mem.Slice(tc.gpa, tc.n)
		if ok != (tc.want == full) {
			t.Errorf("Slice %s (%#x+%#x): ok %v", tc.name, tc.gpa, tc.n, ok)
			continue
		}
		if ok {
			if uint64(len(b)) != tc.n || uint64(cap(b)) != tc.n {
				t.Errorf("Slice %s: len %d cap %d", tc.name, len(b), cap(b))
			}
			if tc.n > 0 && !sameBytes(b, g.host(tc.gpa, int(tc.n))) {
				t.Errorf("Slice %s: wrong host bytes", tc.name)
			}
		}
		// The same through the user address space.
		if g.regionOK(tc.gpa) {
			ub, uok := mem.UserSlice(g.uva(tc.gpa), tc.n)
			if uok != ok || !sameBytes(ub, b) {
				t.Errorf("UserSlice %s: ok %v, differs from Slice", tc.name, uok)
			}
		}
	}

	nexts := []struct {
		name   string
		gpa, n uint64
		ok     bool
		got    uint64
	}{
		{"inside", gpaA + 10, 100, true, 100},
		{"to the end of A", gpaB - 10, 100, true, 10},
		{"B after A", gpaB, 100, true, 100},
		{"last byte", endC - 1, 5, true, 1},
		{"one past", endC, 5, false, 0},
		{"zero length", gpaC, 0, true, 0},
		{"huge length", gpaD, math.MaxUint64, true, sizeD},
		{"gap", 0x30000, 1, false, 0},
		{"top address", math.MaxUint64, 1, false, 0},
	}
	for _, tc := range nexts {
		b, ok := mem.Next(tc.gpa, tc.n)
		if ok != tc.ok || uint64(len(b)) != tc.got || uint64(cap(b)) != tc.got {
			t.Errorf("Next %s (%#x+%#x): %d bytes, ok %v; want %d, %v", tc.name, tc.gpa, tc.n, len(b), ok, tc.got, tc.ok)
			continue
		}
		if ok && tc.got > 0 && !sameBytes(b, g.host(tc.gpa, int(tc.got))) {
			t.Errorf("Next %s: wrong host bytes", tc.name)
		}
	}

	users := []struct {
		name   string
		uva, n uint64
		ok     bool
	}{
		{"start of A", uvaA, 16, true},
		{"last byte of A", uvaA + sizeA - 1, 1, true},
		{"straddles UVA-adjacent A|B", uvaA + sizeA - 8, 16, false},
		{"a GPA is not a UVA", gpaC, 16, false},
		{"below every region", 0x1000, 1, false},
		{"past the last region", uvaA + 0x30000, 1, false},
		{"one past D", uvaD + sizeD, 0, false},
		{"zero at start of D", uvaD, 0, true},
		{"wraps", uvaC + 16, math.MaxUint64 - 8, false},
		{"top", math.MaxUint64, 1, false},
	}
	for _, tc := range users {
		b, ok := mem.UserSlice(tc.uva, tc.n)
		if ok != tc.ok || (ok && uint64(len(b)) != tc.n) {
			t.Errorf("UserSlice %s (%#x+%#x): %d bytes, ok %v", tc.name, tc.uva, tc.n, len(b), ok)
		}
	}
}

// regionOK reports whether gpa lies in a test region (no test failure).
func (g *guest) regionOK(gpa uint64) bool {
	for i := range g.regions {
		r := &g.regions[i]
		if gpa >= r.GuestPhysAddr && gpa-r.GuestPhysAddr < r.Size {
			return true
		}
	}
	return false
}

func TestMappingRefcount(t *testing.T) {
	var released atomic.Int32
	m := NewMapping(make([]byte, 0x2000), func(b []byte) {
		if len(b) != 0x2000 {
			t.Errorf("release got %d bytes", len(b))
		}
		released.Add(1)
	})
	r1, _ := NewRegion(0, 0x1000, 0x10000, 0, m)
	r2, _ := NewRegion(0x1000, 0x1000, 0x20000, 0x1000, m) // same mapping
	g1, err := NewGuestMemory([]Region{r1, r2})
	if err != nil {
		t.Fatal(err)
	}
	m.Put() // the builder's reference
	if released.Load() != 0 {
		t.Fatal("released while a table uses it")
	}

	var mm MemoryMap
	if mm.Acquire() != nil || mm.Current() != nil {
		t.Fatal("empty map returned a table")
	}
	mm.Replace(g1)
	if mm.Current() != g1 {
		t.Fatal("Current is not the installed table")
	}
	a := mm.Acquire()
	b := mm.Acquire()
	if a != g1 || b != g1 {
		t.Fatal("Acquire returned another table")
	}

	// A second table over another mapping replaces the first.
	var released2 atomic.Int32
	m2 := NewMapping(make([]byte, 0x1000), func([]byte) { released2.Add(1) })
	r3, _ := NewRegion(0, 0x1000, 0x10000, 0, m2)
	g2, _ := NewGuestMemory([]Region{r3})
	m2.Put()
	mm.Replace(g2)
	if released.Load() != 0 {
		t.Fatal("replaced table released while requests hold it")
	}
	if buf, ok := a.Slice(0x1800, 8); !ok || len(buf) != 8 {
		t.Fatal("held table no longer translates")
	}
	a.Put()
	if released.Load() != 0 {
		t.Fatal("released with one reference left")
	}
	b.Put()
	if released.Load() != 1 {
		t.Fatalf("released %d times after the last Put, want 1", released.Load())
	}
	if g1.TryGet() {
		t.Fatal("TryGet revived a released table")
	}
	if c := mm.Acquire(); c != g2 {
		t.Fatal("Acquire after replace did not return the new table")
	} else {
		c.Put()
	}
	mm.Replace(nil)
	if released2.Load() != 1 || mm.Acquire() != nil {
		t.Fatalf("Replace(nil): released %d, want 1", released2.Load())
	}
}

func TestQueueHoldsMemory(t *testing.T) {
	g := newGuest(t)
	r := newRing(g, 8)
	q, err := New(r.config(), g.mem)
	if err != nil {
		t.Fatal(err)
	}
	g.mem.Put() // the owner lets go; the ring still uses the table
	if g.released.Load() != 0 {
		t.Fatal("memory released under a live ring")
	}
	q.Close()
	if got := g.released.Load(); got != 3 {
		t.Fatalf("%d mappings released after Close, want 3", got)
	}
	q.Close() // idempotent
	q.Push(0, 0)
	if err := q.Notify(); err != nil {
		t.Fatal(err)
	}
	// A released table cannot back a new ring.
	if _, err := New(r.config(), g.mem); err == nil {
		t.Fatal("New accepted a released table")
	}
}

// TestMemoryMapConcurrent replaces the table while readers acquire it,
// translate and read through it. A reader must never hold a table whose
// mappings are released, and every mapping is released exactly once.
func TestMemoryMapConcurrent(t *testing.T) {
	type tracked struct {
		m    *Mapping
		dead atomic.Bool
		rels atomic.Int32
	}
	var mm MemoryMap
	var all []*tracked
	var mu sync.Mutex
	newTable := func(i int) *GuestMemory {
		tr := &tracked{}
		data := make([]byte, 0x2000)
		data[0x10] = byte(i)
		tr.m = NewMapping(data, func([]byte) { tr.dead.Store(true); tr.rels.Add(1) })
		ra, _ := NewRegion(0, 0x1000, 0x10000, 0, tr.m)
		rb, _ := NewRegion(0x1000, 0x1000, 0x30000, 0x1000, tr.m)
		g, err := NewGuestMemory([]Region{ra, rb})
		if err != nil {
			t.Error(err)
		}
		tr.m.Put()
		mu.Lock()
		all = append(all, tr)
		mu.Unlock()
		return g
	}
	// Which tracked mapping a table uses: found through its region.
	owner := func(g *GuestMemory) *tracked {
		mu.Lock()
		defer mu.Unlock()
		for _, tr := range all {
			if g.Regions()[0].mapping == tr.m {
				return tr
			}
		}
		return nil
	}

	mm.Replace(newTable(0))
	const replaces = 2000
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var acquired atomic.Int64
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				g := mm.Acquire()
				if g == nil {
					continue
				}
				acquired.Add(1)
				if b, ok := g.Slice(0x10, 1); !ok || len(b) != 1 {
					t.Error("held table does not translate")
				}
				if tr := owner(g); tr == nil || tr.dead.Load() {
					t.Error("acquired a table whose mapping is released")
				}
				runtime.Gosched()
				if tr := owner(g); tr.dead.Load() {
					t.Error("mapping released while a reader holds its table")
				}
				g.Put()
			}
		}()
	}
	for i := 1; i <= replaces; i++ {
		mm.Replace(newTable(i))
		if i%100 == 0 {
			runtime.Gosched()
		}
	}
	close(stop)
	wg.Wait()
	mm.Replace(nil)
	for i, tr := range all {
		if tr.rels.Load() != 1 {
			t.Errorf("mapping %d released %d times", i, tr.rels.Load())
		}
	}
	if acquired.Load() == 0 {
		t.Error("readers never acquired a table")
	}
}
