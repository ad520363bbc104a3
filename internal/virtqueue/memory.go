package virtqueue

import (
	"errors"
	"fmt"
	"sort"
	"sync/atomic"
)

// Mapping is one mmap of a front-end memory fd. Several regions may share a
// mapping; it is unmapped when the last table referring to it is released.
type Mapping struct {
	data    []byte
	refs    atomic.Int32
	release func([]byte)
}

// NewMapping wraps mapped bytes; release (e.g. munmap) runs once when the
// last reference is dropped. The returned Mapping holds one reference, which
// the caller gives up with Put after building the tables that use it.
func NewMapping(data []byte, release func([]byte)) *Mapping {
	m := &Mapping{data: data, release: release}
	m.refs.Store(1)
	return m
}

// Get takes a reference.
func (m *Mapping) Get() { m.refs.Add(1) }

// Put drops a reference, releasing the mapping with the last one.
func (m *Mapping) Put() {
	if m.refs.Add(-1) == 0 && m.release != nil {
		m.release(m.data)
		m.data = nil
	}
}

// Region is one guest memory region as the front end describes it.
type Region struct {
	GuestPhysAddr uint64
	Size          uint64
	UserAddr      uint64 // the front end's virtual address of the region
	MmapOffset    uint64

	mapping *Mapping
	host    []byte // mapping.data[MmapOffset : MmapOffset+Size]
}

// NewRegion describes a region whose bytes live in m at MmapOffset. A Region
// holds no reference of its own: the GuestMemory tables containing it do.
func NewRegion(gpa, size, uva, mmapOffset uint64, m *Mapping) (Region, error) {
	r := Region{GuestPhysAddr: gpa, Size: size, UserAddr: uva, MmapOffset: mmapOffset}
	if size == 0 {
		return r, errors.New("region of size 0")
	}
	if gpa+size < gpa || uva+size < uva {
		return r, fmt.Errorf("region %#x+%#x wraps the address space", gpa, size)
	}
	if mmapOffset+size < mmapOffset || mmapOffset+size > uint64(len(m.data)) {
		return r, fmt.Errorf("region mmap offset %#x + size %#x beyond mapping of %#x bytes", mmapOffset, size, len(m.data))
	}
	r.mapping = m
	r.host = m.data[mmapOffset : mmapOffset+size : mmapOffset+size]
	return r, nil
}

// GuestMemory is an immutable table of regions, sorted by guest-physical
// address. Requests hold a reference to the table they were translated
// with, so a table replaced by the front end is unmapped only when the last
// request using it is done.
type GuestMemory struct {
	regions []Region
	byUser  []int // indices into regions sorted by UserAddr
	refs    atomic.Int64
}

// NewGuestMemory builds a table from regions, checking that neither their
// guest-physical nor their user ranges overlap. It takes its own references
// on the regions' mappings; the table starts with one reference, the owner's.
func NewGuestMemory(regions []Region) (*GuestMemory, error) {
	g := &GuestMemory{regions: append([]Region(nil), regions...)}
	for i := range g.regions {
		if g.regions[i].mapping == nil {
			// A zero Region, or one NewRegion refused.
			return nil, fmt.Errorf("region at guest address %#x has no mapping", g.regions[i].GuestPhysAddr)
		}
	}
	sort.Slice(g.regions, func(i, j int) bool { return g.regions[i].GuestPhysAddr < g.regions[j].GuestPhysAddr })
	for i := 1; i < len(g.regions); i++ {
		p, r := &g.regions[i-1], &g.regions[i]
		if p.GuestPhysAddr+p.Size > r.GuestPhysAddr {
			return nil, fmt.Errorf("regions at guest address %#x and %#x overlap", p.GuestPhysAddr, r.GuestPhysAddr)
		}
	}
	g.byUser = make([]int, len(g.regions))
	for i := range g.byUser {
		g.byUser[i] = i
	}
	sort.Slice(g.byUser, func(i, j int) bool { return g.regions[g.byUser[i]].UserAddr < g.regions[g.byUser[j]].UserAddr })
	for i := 1; i < len(g.byUser); i++ {
		p, r := &g.regions[g.byUser[i-1]], &g.regions[g.byUser[i]]
		if p.UserAddr+p.Size > r.UserAddr {
			return nil, fmt.Errorf("regions at user address %#x and %#x overlap", p.UserAddr, r.UserAddr)
		}
	}
	for i := range g.regions {
		g.regions[i].mapping.Get()
	}
	g.refs.Store(1)
	return g, nil
}

// Regions returns the table's regions in guest-physical order.
func (g *GuestMemory) Regions() []Region { return g.regions }

// TryGet takes a reference unless the table is already released.
func (g *GuestMemory) TryGet() bool {
	for {
		r := g.refs.Load()
		if r <= 0 {
			return false
		}
		if g.refs.CompareAndSwap(r, r+1) {
			return true
		}
	}
}

// Put drops a reference; the last one releases the table's mappings.
func (g *GuestMemory) Put() {
	if g.refs.Add(-1) == 0 {
		for i := range g.regions {
			g.regions[i].mapping.Put()
		}
	}
}

// find returns the region containing guest-physical address gpa.
func (g *GuestMemory) find(gpa uint64) *Region {
	rs := g.regions
	i := sort.Search(len(rs), func(i int) bool { return rs[i].GuestPhysAddr+rs[i].Size > gpa })
	if i < len(rs) && rs[i].GuestPhysAddr <= gpa {
		return &rs[i]
	}
	return nil
}

// Slice returns the host bytes of [gpa, gpa+n) if they lie in one region.
func (g *GuestMemory) Slice(gpa, n uint64) ([]byte, bool) {
	r := g.find(gpa)
	if r == nil {
		return nil, false
	}
	off := gpa - r.GuestPhysAddr
	if n > r.Size-off {
		return nil, false
	}
	return r.host[off : off+n : off+n], true
}

// Next returns the host bytes from gpa to the end of the region holding it,
// at most n of them. Callers walk a buffer that straddles adjacent regions
// by calling Next again at gpa+len(result).
func (g *GuestMemory) Next(gpa, n uint64) ([]byte, bool) {
	r := g.find(gpa)
	if r == nil {
		return nil, false
	}
	off := gpa - r.GuestPhysAddr
	c := min(n, r.Size-off)
	return r.host[off : off+c : off+c], true
}

// Gap returns how many of the n bytes from gpa lie outside every region
// before the next region starts (n if none follows). It is 0 when gpa is
// inside a region.
func (g *GuestMemory) Gap(gpa, n uint64) uint64 {
	if g.find(gpa) != nil {
		return 0
	}
	rs := g.regions
	i := sort.Search(len(rs), func(i int) bool { return rs[i].GuestPhysAddr > gpa })
	if i < len(rs) {
		return min(n, rs[i].GuestPhysAddr-gpa)
	}
	return n
}

// UserSlice translates a front-end virtual address range, as used for ring
// addresses, into host bytes; the range must lie in one region.
func (g *GuestMemory) UserSlice(uva, n uint64) ([]byte, bool) {
	b, _, ok := g.userRange(uva, n)
	return b, ok
}

// userRange is UserSlice that also returns the range's guest-physical
// address (a packed ring's used descriptors are logged by it).
func (g *GuestMemory) userRange(uva, n uint64) ([]byte, uint64, bool) {
	bu := g.byUser
	i := sort.Search(len(bu), func(i int) bool {
		r := &g.regions[bu[i]]
		return r.UserAddr+r.Size > uva
	})
	if i == len(bu) {
		return nil, 0, false
	}
	r := &g.regions[bu[i]]
	if r.UserAddr > uva {
		return nil, 0, false
	}
	off := uva - r.UserAddr
	if n > r.Size-off {
		return nil, 0, false
	}
	return r.host[off : off+n : off+n], r.GuestPhysAddr + off, true
}

// MemoryMap holds the current GuestMemory. The front end's thread replaces
// it; the goroutines serving rings take references on the table current
// when they translate chains.
type MemoryMap struct {
	cur atomic.Pointer[GuestMemory]
}

// Acquire returns the current table with a reference held, or nil if no
// memory is mapped.
func (m *MemoryMap) Acquire() *GuestMemory {
	for {
		g := m.cur.Load()
		if g == nil {
			return nil
		}
		if g.TryGet() {
			return g
		}
		// Replaced and released between the load and the get: reload.
	}
}

// Current returns the current table without taking a reference; only for
// the front end's own thread, which is the only writer.
func (m *MemoryMap) Current() *GuestMemory { return m.cur.Load() }

// Replace installs g (whose owner reference the map takes over) and drops the
// owner reference of the previous table.
func (m *MemoryMap) Replace(g *GuestMemory) {
	if old := m.cur.Swap(g); old != nil {
		old.Put()
	}
}
