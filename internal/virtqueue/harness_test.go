package virtqueue

import (
	"encoding/binary"
	"errors"
	"sync/atomic"
	"testing"
	"unsafe"
)

// The test guest's memory, built from plain Go byte slices:
//
//	A: GPA [0x0, 0x10000)          mapping m1 at offset 0x1000
//	B: GPA [0x10000, 0x20000)      mapping m1 at offset 0x20000 (GPA- and
//	                               UVA-adjacent to A, not host-adjacent)
//	C: GPA [0x100000, 0x500000)    mapping m2 at offset 0
//	D: GPA [0x100000000, +0x1000)  mapping m3 at offset 0x1000
//
// User (front-end virtual) addresses differ from guest-physical ones, and
// their order differs from the guest-physical order.
const (
	gpaA, sizeA, uvaA = 0x0, 0x10000, 0x7f00_0001_0000
	gpaB, sizeB, uvaB = 0x10000, 0x10000, 0x7f00_0002_0000
	gpaC, sizeC, uvaC = 0x100000, 0x400000, 0x5555_0000_0000
	gpaD, sizeD, uvaD = 0x1_0000_0000, 0x1000, 0x6000_0000_0000
	endC              = gpaC + sizeC
	endD              = gpaD + sizeD

	// Where the default test ring lives (in C) and where buffers go.
	ringDesc  = 0x100000
	ringAvail = 0x140000
	ringUsed  = 0x150000
	tablesGPA = 0x180000 // indirect tables
	dataGPA   = 0x200000 // buffers
)

type regionSpec struct {
	gpa, size, uva, off uint64
	mapping             int
}

var defaultLayout = []regionSpec{
	{gpaA, sizeA, uvaA, 0x1000, 0},
	{gpaB, sizeB, uvaB, 0x20000, 0},
	{gpaC, sizeC, uvaC, 0, 1},
	{gpaD, sizeD, uvaD, 0x1000, 2},
}

// guest is a guest memory table over Go byte slices, with a count of
// mapping releases.
type guest struct {
	t        testing.TB
	maps     []*Mapping
	backing  [][]byte
	regions  []Region
	mem      *GuestMemory
	released atomic.Int32
}

func newGuest(t testing.TB) *guest {
	return newGuestLayout(t, defaultLayout, []int{0x30000, sizeC, 0x2000})
}

// newGuestLayout builds mappings of the given sizes and the regions in
// them, then drops the mappings' initial references so that the table owns
// them.
func newGuestLayout(t testing.TB, layout []regionSpec, mapSizes []int) *guest {
	t.Helper()
	g := &guest{t: t}
	for _, n := range mapSizes {
		b := make([]byte, n)
		g.backing = append(g.backing, b)
		g.maps = append(g.maps, NewMapping(b, func([]byte) { g.released.Add(1) }))
	}
	for _, s := range layout {
		r, err := NewRegion(s.gpa, s.size, s.uva, s.off, g.maps[s.mapping])
		if err != nil {
			t.Fatalf("NewRegion(%#x): %v", s.gpa, err)
		}
		g.regions = append(g.regions, r)
	}
	mem, err := NewGuestMemory(g.regions)
	if err != nil {
		t.Fatal(err)
	}
	g.mem = mem
	for _, m := range g.maps {
		m.Put()
	}
	return g
}

// region returns the region spec holding gpa.
func (g *guest) region(gpa uint64) *Region {
	for i := range g.regions {
		r := &g.regions[i]
		if gpa >= r.GuestPhysAddr && gpa-r.GuestPhysAddr < r.Size {
			return r
		}
	}
	g.t.Fatalf("test bug: GPA %#x outside the test guest", gpa)
	return nil
}

// host returns the n host bytes at gpa (within one region), computed from
// the region's own description rather than through GuestMemory.
func (g *guest) host(gpa uint64, n int) []byte {
	r := g.region(gpa)
	off := gpa - r.GuestPhysAddr
	if off+uint64(n) > r.Size {
		g.t.Fatalf("test bug: %#x+%#x leaves its region", gpa, n)
	}
	m := r.mapping.Bytes()
	return m[r.MmapOffset+off : r.MmapOffset+off+uint64(n)]
}

// write copies b to guest memory at gpa, across adjacent regions.
func (g *guest) write(gpa uint64, b []byte) {
	for len(b) > 0 {
		r := g.region(gpa)
		c := min(uint64(len(b)), r.Size-(gpa-r.GuestPhysAddr))
		copy(g.host(gpa, int(c)), b[:c])
		gpa += c
		b = b[c:]
	}
}

// read copies n bytes of guest memory at gpa, across adjacent regions.
func (g *guest) read(gpa uint64, n int) []byte {
	var out []byte
	for n > 0 {
		r := g.region(gpa)
		c := min(uint64(n), r.Size-(gpa-r.GuestPhysAddr))
		out = append(out, g.host(gpa, int(c))...)
		gpa += c
		n -= int(c)
	}
	return out
}

func (g *guest) uva(gpa uint64) uint64 {
	r := g.region(gpa)
	return r.UserAddr + gpa - r.GuestPhysAddr
}

// inside reports whether b is a sub-slice of some region's host bytes.
func (g *guest) inside(b []byte) bool {
	if len(b) == 0 {
		return true
	}
	p := uintptr(unsafe.Pointer(&b[0]))
	for i := range g.regions {
		h := g.regions[i].Host()
		lo := uintptr(unsafe.Pointer(&h[0]))
		if p >= lo && p+uintptr(len(b)) <= lo+uintptr(len(h)) {
			return true
		}
	}
	return false
}

// desc is a descriptor as the test driver writes it.
type desc struct {
	addr  uint64
	len   uint32
	flags uint16
	next  uint16
}

func (d desc) bytes() []byte {
	var b [descSize]byte
	binary.LittleEndian.PutUint64(b[0:], d.addr)
	binary.LittleEndian.PutUint32(b[8:], d.len)
	binary.LittleEndian.PutUint16(b[12:], d.flags)
	binary.LittleEndian.PutUint16(b[14:], d.next)
	return b[:]
}

// writeTable writes descriptors as a table at gpa.
func (g *guest) writeTable(gpa uint64, ds ...desc) {
	for i, d := range ds {
		g.write(gpa+uint64(i)*descSize, d.bytes())
	}
}

// ring is the driver side of a split ring laid out in the test guest.
type ring struct {
	g                  *guest
	size               uint16
	desc, avail, used  uint64 // GPAs
	availIdx           uint16 // the driver's next avail index
	eventIdx, indirect bool
}

func newRing(g *guest, size uint16) *ring {
	return &ring{g: g, size: size, desc: ringDesc, avail: ringAvail, used: ringUsed}
}

func (r *ring) config() Config {
	return Config{
		Size:      r.size,
		DescAddr:  r.g.uva(r.desc),
		AvailAddr: r.g.uva(r.avail),
		UsedAddr:  r.g.uva(r.used),
		Base:      uint32(r.availIdx),
		EventIdx:  r.eventIdx,
		Indirect:  r.indirect,
	}
}

// open creates the device side of the ring.
func (r *ring) open(t testing.TB) *Queue {
	t.Helper()
	return openQueue(t, r.config(), r.g.mem)
}

// openQueue creates the device side of a ring, closed when the test ends.
func openQueue(t testing.TB, cfg Config, mem *GuestMemory) *Queue {
	t.Helper()
	q, err := New(cfg, mem)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(q.Close)
	return q
}

func (r *ring) setDesc(i uint16, d desc) { r.g.write(r.desc+uint64(i)*descSize, d.bytes()) }

// publish makes heads available and bumps avail.idx.
func (r *ring) publish(heads ...uint16) {
	for _, h := range heads {
		slot := uint64(r.availIdx % r.size)
		binary.LittleEndian.PutUint16(r.g.host(r.avail+4+2*slot, 2), h)
		r.availIdx++
	}
	r.setAvailIdx(r.availIdx)
}

func (r *ring) setAvailIdx(v uint16) {
	binary.LittleEndian.PutUint16(r.g.host(r.avail+2, 2), v)
}

func (r *ring) setAvailFlags(v uint16) {
	binary.LittleEndian.PutUint16(r.g.host(r.avail, 2), v)
}

func (r *ring) setUsedEvent(v uint16) {
	binary.LittleEndian.PutUint16(r.g.host(r.avail+4+2*uint64(r.size), 2), v)
}

func (r *ring) usedIdx() uint16 {
	return binary.LittleEndian.Uint16(r.g.host(r.used+2, 2))
}

func (r *ring) usedFlags() uint16 {
	return binary.LittleEndian.Uint16(r.g.host(r.used, 2))
}

func (r *ring) setUsedIdx(v uint16) {
	binary.LittleEndian.PutUint16(r.g.host(r.used+2, 2), v)
}

// usedElem returns used ring entry i (mod size).
func (r *ring) usedElem(i uint16) (id, n uint32) {
	b := r.g.host(r.used+4+8*uint64(i%r.size), 8)
	return binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:])
}

func (r *ring) availEvent() uint16 {
	return binary.LittleEndian.Uint16(r.g.host(r.used+4+8*uint64(r.size), 2))
}

func (r *ring) setAvailEvent(v uint16) {
	binary.LittleEndian.PutUint16(r.g.host(r.used+4+8*uint64(r.size), 2), v)
}

// lastAvail is a split ring's next avail index, from its base.
func lastAvail(q *Queue) uint16 { return uint16(q.Base()) }

// Calls only the tests make: the daemon pops with Snapshot and PopSeen and
// pushes and notifies in two steps (internal/vhostuser's runner).

// Pop is Snapshot and PopSeen in one call: it takes the next available
// chain into c, if there is one, and fails as PopSeen does. Without guest
// memory (mem nil) it fails before looking at the ring.
func (q *Queue) Pop(c *DescChain, mem *GuestMemory) (bool, error) {
	if q.broken {
		return false, ErrBroken
	}
	if mem == nil {
		// Nothing to translate buffers with: leave the entry for later.
		return false, errors.New("virtqueue: Pop without guest memory")
	}
	if _, err := q.Snapshot(); err != nil {
		return false, err
	}
	return q.PopSeen(c, mem)
}

// PushNotify pushes one chain and signals the guest if it asked for it.
func (q *Queue) PushNotify(tok Token, n uint32) error {
	if !q.pushDecide(tok, n) {
		return nil
	}
	return q.signal()
}

func (q *Queue) pushDecide(tok Token, n uint32) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.push(tok, n)
	return q.needNotify()
}

// Pending reports whether the guest has published chains not yet popped.
func (q *Queue) Pending() bool {
	if q.broken {
		return false
	}
	switch r := q.ring.(type) {
	case *packedRing:
		return r.pending()
	case *splitRing:
		return r.pending()
	}
	panic("closed queue")
}

// ID returns the chain's head index (split) or buffer id (packed): the low
// 16 bits of its Token in both layouts.
func (c *DescChain) ID() uint16 { return uint16(c.Token) }

// Memory returns the table the chain's segments point into.
func (c *DescChain) Memory() *GuestMemory { return c.mem }

// Bytes returns the mapped bytes.
func (m *Mapping) Bytes() []byte { return m.data }

// Host returns the region's bytes.
func (r *Region) Host() []byte { return r.host }

// SameAs reports whether r describes the same guest memory as o, the rule
// REM_MEM_REG matches by (the mmap offset is not compared).
func (r *Region) SameAs(o *Region) bool {
	return r.GuestPhysAddr == o.GuestPhysAddr && r.Size == o.Size && r.UserAddr == o.UserAddr
}
