package vmm

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The shared-memory window (QEMU 11.1's VHOST_USER_PROTOCOL_F_SHMEM, DESIGN
// §13), as QEMU serves it: with Options.Shmem the front end acknowledges
// the SHMEM protocol feature when the back end offers it, asks
// GET_SHMEM_CONFIG at Init and, when region 0 has a size, reserves an
// address range of that size, placed in guest-physical space at
// Options.WindowBase (a PCI BAR in QEMU). ServeWindow answers SHMEM_MAP and
// SHMEM_UNMAP on the back-end channel as QEMU does: it maps the file into
// its reservation, then tells the back end of the new memory region
// (ADD_MEM_REG; REM_MEM_REG for an unmap) and waits for its ack before it
// answers 0 — so a back end that waits for its answer without serving its
// front-end channel deadlocks here as it would with QEMU.

// DefaultWindowBase is where the window lies in guest-physical space when
// Options.WindowBase is 0: above the default layout's high region.
const DefaultWindowBase = 16 * GiB

// windowHVA is the fake front-end virtual address of the window: the
// memory regions of its mappings carry windowHVA + shm_offset.
const windowHVA = 0x6000_0000_0000

// Window is the front end's side of shared-memory region 0.
type Window struct {
	Base uint64 // guest-physical address of the window
	Size uint64 // GET_SHMEM_CONFIG's size of region 0

	mu   sync.Mutex
	host []byte          // the reservation: PROT_NONE where nothing is mapped
	maps []WindowMapping // sorted by ShmOffset
}

// WindowMapping is one live mapping of the window.
type WindowMapping struct {
	ShmemMsg
	fd int // our dup of the mapped file
}

func newWindow(base, size uint64) (*Window, error) {
	if size == 0 || size%PageSize != 0 {
		return nil, fmt.Errorf("vmm: window size %#x", size)
	}
	host, err := unix.Mmap(-1, 0, int(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("vmm: reserve window: %w", err)
	}
	return &Window{Base: base, Size: size, host: host}, nil
}

// Host returns the window's host view; only mapped ranges may be touched.
func (w *Window) Host() []byte { return w.host }

// Mappings returns the live mappings.
func (w *Window) Mappings() []WindowMapping {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]WindowMapping(nil), w.maps...)
}

// region is the memory region of mapping s as QEMU announces it.
func (w *Window) region(s ShmemMsg) MemRegion {
	return MemRegion{GuestPhysAddr: w.Base + s.ShmOffset, MemorySize: s.Len,
		UserAddr: windowHVA + s.ShmOffset, MmapOffset: s.FdOffset}
}

// reserve puts the reservation back over [off, off+n).
func (w *Window) reserve(off, n uint64) error {
	_, err := unix.MmapPtr(-1, 0, unsafe.Pointer(&w.host[off]), uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED)
	return err
}

// close unmaps the window and closes the mapped files.
func (w *Window) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range w.maps {
		unix.Close(m.fd)
	}
	w.maps = nil
	if w.host != nil {
		unix.Munmap(w.host)
		w.host = nil
	}
}

// Drop forgets every mapping without telling the back end, as QEMU does at
// a system reset.
func (w *Window) Drop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range w.maps {
		w.reserve(m.ShmOffset, m.Len)
		unix.Close(m.fd)
	}
	w.maps = nil
}

// getShmemConfig asks for the back end's regions and sets up the window
// of region 0.
func (d *Device) getShmemConfig() error {
	m, err := d.Conn.Call(GetShmemConfig, nil, nil)
	if err != nil {
		return err
	}
	m.CloseFds()
	if len(m.Payload) != ShmemConfigSize {
		return fmt.Errorf("vmm: GET_SHMEM_CONFIG reply of %d bytes, want %d", len(m.Payload), ShmemConfigSize)
	}
	d.ShmemRegions = le.Uint32(m.Payload)
	size := le.Uint64(m.Payload[8:])
	if d.ShmemRegions == 0 || size == 0 {
		return nil
	}
	base := d.opts.WindowBase
	if base == 0 {
		base = DefaultWindowBase
	}
	d.Window, err = newWindow(base, size)
	return err
}

// ServeWindow answers SHMEM_MAP and SHMEM_UNMAP as QEMU does (answer 0 on
// success, 1 on any failure) and FS_IO as ServeFSIO. It is a
// BackendHandler.
func (d *Device) ServeWindow(m *Message) uint64 {
	switch m.Request {
	case BackendShmemMap:
		if err := d.shmemMap(m); err != nil {
			d.windowErr(err)
			return 1
		}
		return 0
	case BackendShmemUnmap:
		if err := d.shmemUnmap(m); err != nil {
			d.windowErr(err)
			return 1
		}
		return 0
	}
	return d.ServeFSIO(m)
}

func (d *Device) windowErr(err error) {
	d.windowMu.Lock()
	d.windowErrs = append(d.windowErrs, err.Error())
	d.windowMu.Unlock()
}

// WindowErrors returns why ServeWindow refused requests, in order.
func (d *Device) WindowErrors() []string {
	d.windowMu.Lock()
	defer d.windowMu.Unlock()
	return append([]string(nil), d.windowErrs...)
}

func (d *Device) shmemMap(m *Message) error {
	s, err := ParseShmemMsg(m.Payload)
	if err != nil {
		return err
	}
	if len(m.Fds) != 1 {
		return fmt.Errorf("SHMEM_MAP with %d fds", len(m.Fds))
	}
	return d.MapWindow(s, m.Fds[0])
}

// MapWindow does what QEMU does for a SHMEM_MAP of fd: maps it into the
// window (refusing overlaps and a file too small) and announces the region
// with ADD_MEM_REG, waiting for the ack. The fd stays the caller's.
func (d *Device) MapWindow(s ShmemMsg, fd int) error {
	w := d.Window
	if w == nil {
		return errors.New("no window")
	}
	if s.ShmID != 0 || s.Len == 0 || s.ShmOffset%PageSize != 0 || s.Len%PageSize != 0 ||
		s.FdOffset%PageSize != 0 || s.ShmOffset >= w.Size || s.Len > w.Size-s.ShmOffset {
		return fmt.Errorf("bad mapping %+v", s)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if uint64(st.Size) < s.FdOffset+s.Len {
		return fmt.Errorf("backing store size %#x is too small for %#x at %#x", st.Size, s.Len, s.FdOffset)
	}
	w.mu.Lock()
	for _, o := range w.maps {
		if o.ShmOffset < s.ShmOffset+s.Len && s.ShmOffset < o.ShmOffset+o.Len {
			w.mu.Unlock()
			return fmt.Errorf("mapping %#x+%#x overlaps %#x+%#x", s.ShmOffset, s.Len, o.ShmOffset, o.Len)
		}
	}
	prot := unix.PROT_READ
	if s.Flags&ShmemWritable != 0 {
		prot |= unix.PROT_WRITE
	}
	_, err := unix.MmapPtr(fd, int64(s.FdOffset), unsafe.Pointer(&w.host[s.ShmOffset]), uintptr(s.Len), prot,
		unix.MAP_SHARED|unix.MAP_FIXED)
	if err != nil {
		w.mu.Unlock()
		return fmt.Errorf("mmap: %w", err)
	}
	own, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		w.reserve(s.ShmOffset, s.Len)
		w.mu.Unlock()
		return err
	}
	w.maps = append(w.maps, WindowMapping{s, own})
	sort.Slice(w.maps, func(i, j int) bool { return w.maps[i].ShmOffset < w.maps[j].ShmOffset })
	w.mu.Unlock()
	// QEMU commits the memory transaction: the back end learns of the
	// region, and acks, before the map is answered.
	if err := d.Conn.AddMemReg(w.region(s), own); err != nil {
		d.dropMapping(s)
		return fmt.Errorf("ADD_MEM_REG: %w", err)
	}
	return nil
}

func (d *Device) shmemUnmap(m *Message) error {
	s, err := ParseShmemMsg(m.Payload)
	if err != nil {
		return err
	}
	return d.UnmapWindow(s)
}

// UnmapWindow does what QEMU does for a SHMEM_UNMAP: the mapping must be
// an existing one's exact range; REM_MEM_REG (with the fd, as QEMU) is
// acked before the window gives the range back to its reservation.
func (d *Device) UnmapWindow(s ShmemMsg) error {
	w := d.Window
	if w == nil {
		return errors.New("no window")
	}
	w.mu.Lock()
	i := sort.Search(len(w.maps), func(i int) bool { return w.maps[i].ShmOffset >= s.ShmOffset })
	if s.ShmID != 0 || i == len(w.maps) || w.maps[i].ShmOffset != s.ShmOffset || w.maps[i].Len != s.Len {
		w.mu.Unlock()
		return fmt.Errorf("no mapping %#x+%#x", s.ShmOffset, s.Len)
	}
	old := w.maps[i]
	w.mu.Unlock()
	err := d.Conn.RemMemReg(w.region(old.ShmemMsg), old.fd)
	d.dropMapping(old.ShmemMsg)
	if err != nil {
		return fmt.Errorf("REM_MEM_REG: %w", err)
	}
	return nil
}

// dropMapping removes mapping s from the window (no message).
func (d *Device) dropMapping(s ShmemMsg) {
	w := d.Window
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, o := range w.maps {
		if o.ShmOffset == s.ShmOffset && o.Len == s.Len {
			w.reserve(o.ShmOffset, o.Len)
			unix.Close(o.fd)
			w.maps = append(w.maps[:i], w.maps[i+1:]...)
			return
		}
	}
}
