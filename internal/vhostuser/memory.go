package vhostuser

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// mapRegion maps the front end's memory fd for region d and returns the
// mapping and the region's offset in it. The fd is mapped from offset 0 for
// mmap_offset+size bytes, as libvhost-user does: an mmap offset that is not
// a multiple of the huge page size fails on hugetlbfs, where Kata's guest
// memory may live. Other files are mapped from mmap_offset rounded down to
// a page: a DAX window region (window.go) is a host file mapped at its
// file offset, which may lie far into a large file, and mapping everything
// before it would waste the address space 256 times over.
func mapRegion(fd int, d memRegionDesc) (*virtqueue.Mapping, uint64, error) {
	if d.size == 0 {
		return nil, 0, fmt.Errorf("region at %#x has size 0", d.gpa)
	}
	end := d.mmapOffset + d.size
	if end < d.mmapOffset || end > 1<<47 {
		return nil, 0, fmt.Errorf("region at %#x: mmap offset %#x + size %#x out of range", d.gpa, d.mmapOffset, d.size)
	}
	if d.gpa+d.size < d.gpa || d.uva+d.size < d.uva {
		return nil, 0, fmt.Errorf("region at %#x: size %#x wraps", d.gpa, d.size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, 0, fmt.Errorf("region at %#x: fstat: %w", d.gpa, err)
	}
	// Touching a page beyond the end of the file would raise SIGBUS.
	if st.Mode&unix.S_IFMT == unix.S_IFREG && uint64(st.Size) < end {
		return nil, 0, fmt.Errorf("region at %#x: fd holds %#x bytes, region needs %#x", d.gpa, st.Size, end)
	}
	var start uint64
	var sfs unix.Statfs_t
	if unix.Fstatfs(fd, &sfs) == nil && sfs.Type != unix.HUGETLBFS_MAGIC {
		start = d.mmapOffset &^ (windowPage - 1)
	}
	data, err := unix.Mmap(fd, int64(start), int(end-start), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_NORESERVE)
	if err == unix.EACCES {
		// A file opened read-only: a read-only window mapping from a VMM
		// that honours its flags. Reads into it fail with EFAULT (preadv)
		// or a recovered fault (server goroutines), never the daemon.
		data, err = unix.Mmap(fd, int64(start), int(end-start), unix.PROT_READ, unix.MAP_SHARED|unix.MAP_NORESERVE)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("region at %#x: mmap %#x bytes at %#x: %w", d.gpa, end-start, start, err)
	}
	return virtqueue.NewMapping(data, func(b []byte) { unix.Munmap(b) }), d.mmapOffset - start, nil
}

// install builds a table from regions and makes it current. The new table
// takes references on the regions' mappings; the table it replaces is
// unmapped once no request uses it.
func (b *Backend) install(regions []virtqueue.Region) error {
	g, err := virtqueue.NewGuestMemory(regions)
	if err != nil {
		return err
	}
	b.memory.Replace(g)
	b.regions = g.Regions()
	return nil
}

// setMemTable replaces all regions. Rings keep running: they hold the table
// their ring addresses were translated with, and new chains use the new one.
func (b *Backend) setMemTable(m *Message) error {
	descs, err := payloadMemTable(m)
	if err != nil {
		return fmt.Errorf("set mem table: %w", err)
	}
	regions := make([]virtqueue.Region, 0, len(descs))
	var maps []*virtqueue.Mapping
	defer func() {
		for _, mp := range maps {
			mp.Put() // the table holds its own references
		}
	}()
	for i, d := range descs {
		mp, off, err := mapRegion(m.FDs[i], d)
		if err != nil {
			return fmt.Errorf("set mem table: region %d: %w", i, err)
		}
		maps = append(maps, mp)
		r, err := virtqueue.NewRegion(d.gpa, d.size, d.uva, off, mp)
		if err != nil {
			return fmt.Errorf("set mem table: region %d: %w", i, err)
		}
		regions = append(regions, r)
	}
	if err := b.install(regions); err != nil {
		return fmt.Errorf("set mem table: %w", err)
	}
	for _, r := range regions {
		b.window.regionAdded(r.Size)
		b.log.Debug("memory region", "gpa", fmt.Sprintf("%#x", r.GuestPhysAddr), "size", r.Size,
			"uva", fmt.Sprintf("%#x", r.UserAddr), "mmap_offset", r.MmapOffset)
	}
	return nil
}

// addMemReg adds one region (memory hotplug) while rings may run.
func (b *Backend) addMemReg(m *Message) error {
	d, err := payloadSingleRegion(m)
	if err != nil {
		return fmt.Errorf("add mem reg: %w", err)
	}
	if len(m.FDs) != 1 {
		return fmt.Errorf("add mem reg: %d fds, want 1", len(m.FDs))
	}
	for i := range b.regions {
		r := &b.regions[i]
		if r.GuestPhysAddr == d.gpa && r.Size == d.size && r.UserAddr == d.uva {
			return nil // already present: QEMU may resend after a restart
		}
	}
	if len(b.regions) >= maxMemSlots {
		return fmt.Errorf("add mem reg: all %d slots in use", maxMemSlots)
	}
	mp, off, err := mapRegion(m.FDs[0], d)
	if err != nil {
		return fmt.Errorf("add mem reg: %w", err)
	}
	defer mp.Put()
	r, err := virtqueue.NewRegion(d.gpa, d.size, d.uva, off, mp)
	if err != nil {
		return fmt.Errorf("add mem reg: %w", err)
	}
	regions := append(append([]virtqueue.Region(nil), b.regions...), r)
	if err := b.install(regions); err != nil {
		return fmt.Errorf("add mem reg: %w", err)
	}
	b.log.Debug("memory region added", "gpa", fmt.Sprintf("%#x", d.gpa), "size", d.size)
	b.window.regionAdded(d.size)
	return nil
}

// remMemReg removes the region matching guest address, size and user
// address (not the mmap offset). It is unmapped when the last request
// using it completes.
func (b *Backend) remMemReg(m *Message) error {
	d, err := payloadSingleRegion(m)
	if err != nil {
		return fmt.Errorf("rem mem reg: %w", err)
	}
	regions := make([]virtqueue.Region, 0, len(b.regions))
	found := false
	for _, r := range b.regions {
		if !found && r.GuestPhysAddr == d.gpa && r.Size == d.size && r.UserAddr == d.uva {
			found = true
			continue
		}
		regions = append(regions, r)
	}
	if !found {
		return fmt.Errorf("rem mem reg: no region at %#x size %#x", d.gpa, d.size)
	}
	if err := b.install(regions); err != nil {
		return fmt.Errorf("rem mem reg: %w", err)
	}
	b.log.Debug("memory region removed", "gpa", fmt.Sprintf("%#x", d.gpa), "size", d.size)
	return nil
}
