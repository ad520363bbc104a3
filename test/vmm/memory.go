package vmm

import (
	"errors"
	"fmt"
	"sort"
	"sync"

	"golang.org/x/sys/unix"
)

// PageSize is the guest page size the driver model assumes (x86-64).
const PageSize = 4096

// GiB and MiB are handy for layouts.
const (
	MiB = 1 << 20
	GiB = 1 << 30
)

// hvaBase is where fake front-end virtual addresses start. Region i gets
// hvaBase + i*hvaStride, so HVAs are never equal to GPAs and are never
// contiguous even when the GPAs are.
const (
	hvaBase   = 0x7f00_0000_0000
	hvaStride = 1 << 36
)

// RegionSpec describes one guest RAM region as the front end announces it
// in SET_MEM_TABLE or ADD_MEM_REG.
type RegionSpec struct {
	GuestPhysAddr uint64 // start of the region in guest-physical space
	Size          uint64 // length in bytes, a multiple of PageSize
	UserAddr      uint64 // front-end virtual address (userspace_addr); 0 picks one
	File          int    // backing memfd number; regions with equal File share a memfd
	MmapOffset    uint64 // offset of the region inside its memfd, page aligned
}

// SplitLayout is QEMU's low/high split with one memfd per region: region 0
// at GPA 0 of size low, region 1 at GPA 4 GiB of size high.
func SplitLayout(low, high uint64) []RegionSpec {
	return []RegionSpec{
		{GuestPhysAddr: 0, Size: low, File: 0},
		{GuestPhysAddr: 4 * GiB, Size: high, File: 1},
	}
}

// SharedLayout is what QEMU sends for one memory-backend-memfd larger than
// the 32-bit PCI hole: both regions live in a single memfd, the high one at
// mmap_offset low.
func SharedLayout(low, high uint64) []RegionSpec {
	return []RegionSpec{
		{GuestPhysAddr: 0, Size: low, File: 0, MmapOffset: 0},
		{GuestPhysAddr: 4 * GiB, Size: high, File: 0, MmapOffset: low},
	}
}

// ContiguousLayout places regions back to back in guest-physical space
// starting at base (so a buffer or an indirect table can straddle a
// boundary), each in its own memfd and with discontiguous HVAs.
func ContiguousLayout(base uint64, sizes ...uint64) []RegionSpec {
	var l []RegionSpec
	gpa := base
	for i, s := range sizes {
		l = append(l, RegionSpec{GuestPhysAddr: gpa, Size: s, File: i})
		gpa += s
	}
	return l
}

// Region is one mapped guest RAM region.
type Region struct {
	RegionSpec
	fd   int    // the memfd (shared with other regions of the same File)
	host []byte // our mapping of exactly this region
}

// End is the first guest-physical address after the region.
func (r *Region) End() uint64 { return r.GuestPhysAddr + r.Size }

// Fd is the memfd backing the region, to be sent with SCM_RIGHTS. It stays
// owned by the Memory.
func (r *Region) Fd() int { return r.fd }

// Host is the host view of the whole region.
func (r *Region) Host() []byte { return r.host }

// MemRegion is the region's wire description.
func (r *Region) MemRegion() MemRegion {
	return MemRegion{
		GuestPhysAddr: r.GuestPhysAddr,
		MemorySize:    r.Size,
		UserAddr:      r.UserAddr,
		MmapOffset:    r.MmapOffset,
	}
}

// Memory is the guest's RAM.
type Memory struct {
	regions []*Region
	files   map[int]int    // File number -> memfd
	maps    map[int][]byte // File number -> our mapping of the whole memfd

	mu    sync.Mutex
	free  [][]span          // per region, sorted, disjoint
	alloc map[uint64][]span // allocation start -> spans it took
}

type span struct{ start, end uint64 }

// NewMemory creates memfds for the layout, sizes and maps them, and sets up
// the allocator. Regions must not overlap in guest-physical or HVA space.
func NewMemory(layout []RegionSpec) (*Memory, error) {
	if len(layout) == 0 {
		return nil, errors.New("vmm: empty memory layout")
	}
	m := &Memory{files: map[int]int{}, maps: map[int][]byte{}, alloc: map[uint64][]span{}}
	fileSize := map[int]uint64{}
	for i, s := range layout {
		if s.Size == 0 || s.Size%PageSize != 0 || s.GuestPhysAddr%PageSize != 0 || s.MmapOffset%PageSize != 0 {
			return nil, fmt.Errorf("vmm: region %d: size, GPA and offset must be page aligned and non-zero size", i)
		}
		if s.UserAddr == 0 {
			s.UserAddr = hvaBase + uint64(i)*hvaStride
		}
		if e := s.MmapOffset + s.Size; e > fileSize[s.File] {
			fileSize[s.File] = e
		}
		m.regions = append(m.regions, &Region{RegionSpec: s})
	}
	for i, a := range m.regions {
		for _, b := range m.regions[i+1:] {
			if a.GuestPhysAddr < b.End() && b.GuestPhysAddr < a.End() {
				return nil, fmt.Errorf("vmm: regions at GPA %#x and %#x overlap", a.GuestPhysAddr, b.GuestPhysAddr)
			}
			if a.UserAddr < b.UserAddr+b.Size && b.UserAddr < a.UserAddr+a.Size {
				return nil, fmt.Errorf("vmm: regions at HVA %#x and %#x overlap", a.UserAddr, b.UserAddr)
			}
		}
	}
	files := make([]int, 0, len(fileSize))
	for f := range fileSize {
		files = append(files, f)
	}
	sort.Ints(files)
	for _, f := range files {
		fd, err := unix.MemfdCreate(fmt.Sprintf("vmm-guest-ram-%d", f), unix.MFD_CLOEXEC)
		if err != nil {
			m.Close()
			return nil, fmt.Errorf("vmm: memfd_create: %w", err)
		}
		m.files[f] = fd
		if err := unix.Ftruncate(fd, int64(fileSize[f])); err != nil {
			m.Close()
			return nil, fmt.Errorf("vmm: ftruncate memfd: %w", err)
		}
		b, err := unix.Mmap(fd, 0, int(fileSize[f]), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_NORESERVE)
		if err != nil {
			m.Close()
			return nil, fmt.Errorf("vmm: mmap memfd: %w", err)
		}
		m.maps[f] = b
	}
	for _, r := range m.regions {
		r.fd = m.files[r.File]
		r.host = m.maps[r.File][r.MmapOffset : r.MmapOffset+r.Size : r.MmapOffset+r.Size]
		s := span{r.GuestPhysAddr, r.End()}
		if s.start == 0 {
			s.start = PageSize // keep GPA 0 out of the allocator: a zero address is then always a bug
		}
		m.free = append(m.free, []span{s})
	}
	return m, nil
}

// Close unmaps guest RAM and closes the memfds. Any slice obtained from the
// Memory is invalid afterwards.
func (m *Memory) Close() error {
	for f, b := range m.maps {
		unix.Munmap(b)
		delete(m.maps, f)
	}
	for f, fd := range m.files {
		unix.Close(fd)
		delete(m.files, f)
	}
	return nil
}

// Regions returns the regions in layout order.
func (m *Memory) Regions() []*Region { return m.regions }

// Region returns the region containing gpa, or nil.
func (m *Memory) Region(gpa uint64) *Region {
	for _, r := range m.regions {
		if gpa >= r.GuestPhysAddr && gpa < r.End() {
			return r
		}
	}
	return nil
}

// HVA translates a guest-physical address to the front end's virtual
// address, as QEMU does before it sends ring addresses.
func (m *Memory) HVA(gpa uint64) (uint64, error) {
	r := m.Region(gpa)
	if r == nil {
		return 0, fmt.Errorf("vmm: GPA %#x is not guest RAM", gpa)
	}
	return r.UserAddr + (gpa - r.GuestPhysAddr), nil
}

// Slice returns the host bytes of [gpa, gpa+n), which must lie inside one
// region. The slice aliases guest memory.
func (m *Memory) Slice(gpa, n uint64) ([]byte, error) {
	r := m.Region(gpa)
	if r == nil || n > r.End()-gpa {
		return nil, fmt.Errorf("vmm: GPA range [%#x, +%#x) is not inside one region", gpa, n)
	}
	off := gpa - r.GuestPhysAddr
	return r.host[off : off+n : off+n], nil
}

// each calls fn for the pieces of [gpa, gpa+n) in consecutive regions.
func (m *Memory) each(gpa, n uint64, fn func(host []byte, done uint64)) error {
	var done uint64
	for done < n {
		r := m.Region(gpa + done)
		if r == nil {
			return fmt.Errorf("vmm: GPA %#x is not guest RAM", gpa+done)
		}
		off := gpa + done - r.GuestPhysAddr
		k := min(n-done, r.Size-off)
		fn(r.host[off:off+k], done)
		done += k
	}
	return nil
}

// WriteAt copies p into guest memory at gpa; the range may cross
// GPA-contiguous regions.
func (m *Memory) WriteAt(p []byte, gpa uint64) error {
	return m.each(gpa, uint64(len(p)), func(h []byte, done uint64) { copy(h, p[done:]) })
}

// ReadAt copies guest memory at gpa into p; the range may cross
// GPA-contiguous regions.
func (m *Memory) ReadAt(p []byte, gpa uint64) error {
	return m.each(gpa, uint64(len(p)), func(h []byte, done uint64) { copy(p[done:], h) })
}

// Alloc hands out n bytes of guest memory aligned to align (a power of two;
// 0 means 8), first fit over the regions in layout order. The memory is
// zeroed. It never straddles regions.
func (m *Memory) Alloc(n, align uint64) (uint64, error) {
	return m.AllocIn(-1, n, align)
}

// AllocIn is Alloc restricted to region i (i < 0: any region).
func (m *Memory) AllocIn(i int, n, align uint64) (uint64, error) {
	if n == 0 {
		n = 1
	}
	if align == 0 {
		align = 8
	}
	if align&(align-1) != 0 {
		return 0, fmt.Errorf("vmm: alignment %d is not a power of two", align)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for ri := range m.regions {
		if i >= 0 && ri != i {
			continue
		}
		for _, s := range m.free[ri] {
			start := (s.start + align - 1) &^ (align - 1)
			if start >= s.start && start+n <= s.end {
				m.take(ri, start, start+n)
				m.alloc[start] = []span{{start, start + n}}
				return start, m.zero(start, n)
			}
		}
	}
	return 0, fmt.Errorf("vmm: out of guest memory for %d bytes (region %d)", n, i)
}

// AllocAt reserves exactly [gpa, gpa+n), which may cross GPA-contiguous
// regions (for buffers and tables that straddle a region boundary). It
// fails if any byte is already allocated or not guest RAM.
func (m *Memory) AllocAt(gpa, n uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var spans []span
	for a := gpa; a < gpa+n; {
		r := m.Region(a)
		if r == nil {
			return fmt.Errorf("vmm: GPA %#x is not guest RAM", a)
		}
		e := min(gpa+n, r.End())
		spans = append(spans, span{a, e})
		a = e
	}
	for _, s := range spans {
		if !m.isFree(m.index(s.start), s) {
			return fmt.Errorf("vmm: [%#x, %#x) is already allocated", s.start, s.end)
		}
	}
	for _, s := range spans {
		m.take(m.index(s.start), s.start, s.end)
	}
	m.alloc[gpa] = spans
	return m.zero(gpa, n)
}

// Free returns an allocation made by Alloc, AllocIn or AllocAt.
func (m *Memory) Free(gpa uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	spans, ok := m.alloc[gpa]
	if !ok {
		panic(fmt.Sprintf("vmm: Free(%#x) of memory that was not allocated", gpa))
	}
	delete(m.alloc, gpa)
	for _, s := range spans {
		ri := m.index(s.start)
		f := append(m.free[ri], s)
		sort.Slice(f, func(a, b int) bool { return f[a].start < f[b].start })
		merged := f[:1]
		for _, x := range f[1:] {
			if last := &merged[len(merged)-1]; last.end == x.start {
				last.end = x.end
			} else {
				merged = append(merged, x)
			}
		}
		m.free[ri] = merged
	}
}

func (m *Memory) index(gpa uint64) int {
	for i, r := range m.regions {
		if gpa >= r.GuestPhysAddr && gpa < r.End() {
			return i
		}
	}
	return -1
}

func (m *Memory) isFree(ri int, s span) bool {
	for _, f := range m.free[ri] {
		if s.start >= f.start && s.end <= f.end {
			return true
		}
	}
	return false
}

// take removes [start, end) from region ri's free list; the caller has
// checked that it is free.
func (m *Memory) take(ri int, start, end uint64) {
	var out []span
	for _, f := range m.free[ri] {
		if end <= f.start || start >= f.end {
			out = append(out, f)
			continue
		}
		if f.start < start {
			out = append(out, span{f.start, start})
		}
		if end < f.end {
			out = append(out, span{end, f.end})
		}
	}
	m.free[ri] = out
}

func (m *Memory) zero(gpa, n uint64) error {
	return m.each(gpa, n, func(h []byte, _ uint64) { clear(h) })
}
