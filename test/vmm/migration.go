package vmm

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Migration, as QEMU ≥ 8.2 drives it for vhost-user-fs (hw/virtio/vhost.c,
// vhost-user.c): a dirty log the back end sets bits in while LOG_ALL is on,
// and the back end's own state moved through a pipe once the rings stopped.

// VringFLog is SET_VRING_ADDR's VHOST_VRING_F_LOG flag: log used-ring writes.
const VringFLog = 1

// Device-state transfer directions and the one phase (SET_DEVICE_STATE_FD).
const (
	TransferSave = 0
	TransferLoad = 1
	PhaseStopped = 0
)

// LogPageSize is the granule of the dirty log: one bit per 4 KiB page.
const LogPageSize = 4096

// DirtyLog is a dirty-page bitmap in a sealed-size memfd, as QEMU's
// vhost_log_alloc makes it: one bit per 4 KiB guest-physical page.
type DirtyLog struct {
	fd   int
	bits []byte // mapped; the back end sets bits in it
	Size uint64
}

// NewDirtyLog makes a log covering guest-physical addresses below limit.
func NewDirtyLog(limit uint64) (*DirtyLog, error) {
	pages := (limit + LogPageSize - 1) / LogPageSize
	size := (pages + 63) / 64 * 8 // u64 chunks, as QEMU sizes it
	fd, err := unix.MemfdCreate("vmm-dirty-log", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, err
	}
	unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL)
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &DirtyLog{fd: fd, bits: b, Size: size}, nil
}

// NewDirtyLogFor makes a log covering all of m's regions.
func NewDirtyLogFor(m *Memory) (*DirtyLog, error) {
	var limit uint64
	for _, r := range m.Regions() {
		limit = max(limit, r.End())
	}
	return NewDirtyLog(limit)
}

// Fd is the memfd to send with SET_LOG_BASE.
func (l *DirtyLog) Fd() int { return l.fd }

// words views the bitmap as u64 words, as QEMU reads it.
func (l *DirtyLog) words() []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(&l.bits[0])), len(l.bits)/8)
}

// Pages returns the guest-physical page numbers whose bits are set.
func (l *DirtyLog) Pages() map[uint64]bool {
	set := map[uint64]bool{}
	ws := l.words()
	for i := range ws {
		w := atomic.LoadUint64(&ws[i])
		for b := uint64(0); w != 0; b++ {
			if w&1 != 0 {
				set[uint64(i)*64+b] = true
			}
			w >>= 1
		}
	}
	return set
}

// Sync reads and clears the bitmap as QEMU's vhost_log_sync does (an
// atomic exchange per word) and returns the pages that were set.
func (l *DirtyLog) Sync() map[uint64]bool {
	set := map[uint64]bool{}
	ws := l.words()
	for i := range ws {
		w := atomic.SwapUint64(&ws[i], 0)
		for b := uint64(0); w != 0; b++ {
			if w&1 != 0 {
				set[uint64(i)*64+b] = true
			}
			w >>= 1
		}
	}
	return set
}

// Close unmaps and closes the log.
func (l *DirtyLog) Close() error {
	unix.Munmap(l.bits)
	return unix.Close(l.fd)
}

// PagesOf returns the log pages [gpa, gpa+n) touches.
func PagesOf(gpa, n uint64) []uint64 {
	if n == 0 {
		return nil
	}
	var ps []uint64
	for p := gpa / LogPageSize; p <= (gpa+n-1)/LogPageSize; p++ {
		ps = append(ps, p)
	}
	return ps
}

// SetLogBaseFor sends SET_LOG_BASE with l (size, offset 0, the memfd).
func (d *Device) SetLogBaseFor(l *DirtyLog) error {
	return d.Conn.SetLogBase(l.Size, 0, l.fd)
}

// StartLogging is vhost_migration_log(true) on a running device: the log,
// then SET_FEATURES with LOG_ALL, then SET_VRING_ADDR with VHOST_VRING_F_LOG
// on every ring, each awaited (QEMU aborts the migration on a refusal).
// While logging, StartRings follows vhost_dev_start's order: SET_FEATURES
// with LOG_ALL first, the rings with the flag, SET_LOG_BASE last.
func (d *Device) StartLogging(l *DirtyLog) error {
	if err := d.SetLogBaseFor(l); err != nil {
		return err
	}
	d.logging, d.log = true, l
	if err := d.Conn.SetFeatures(d.Features | Bit(FLogAll)); err != nil {
		return err
	}
	for i := range d.Queues {
		if err := d.setRingLog(i, true); err != nil {
			return fmt.Errorf("ring %d: %w", i, err)
		}
	}
	return nil
}

// StopLogging is vhost_migration_log(false): SET_FEATURES without LOG_ALL,
// then SET_VRING_ADDR with flags 0 on every ring, none awaited (so a
// refusal goes unseen, as with QEMU), then a GET_FEATURES to be in step.
func (d *Device) StopLogging() error {
	d.logging, d.log = false, nil
	if err := d.Conn.SetFeatures(d.Features); err != nil {
		return err
	}
	for i := range d.Queues {
		a, err := d.ringAddr(i)
		if err != nil {
			return err
		}
		if err := d.Conn.Send(SetVringAddr, 0, a.Bytes(), nil); err != nil {
			return err
		}
	}
	_, err := d.Conn.GetFeatures()
	return err
}

// setRingLog sends SET_VRING_ADDR for ring i with the log flag as given,
// NEED_REPLY set.
func (d *Device) setRingLog(i int, on bool) error {
	a, err := d.ringAddr(i)
	if err != nil {
		return err
	}
	if !on {
		a.Flags &^= VringFLog
	}
	_, err = d.Conn.CallFlags(SetVringAddr, a.Bytes(), nil, d.HasProtocol(PReplyAck))
	return err
}

// ringAddr is ring i's SET_VRING_ADDR payload, with VHOST_VRING_F_LOG while
// the device logs.
func (d *Device) ringAddr(i int) (VringAddr, error) {
	a, err := d.Queues[i].VringAddr()
	if d.logging {
		a.Flags |= VringFLog
	}
	return a, err
}

// SaveState is the source's side of a state transfer, once the rings are
// stopped: SET_DEVICE_STATE_FD(save) with a pipe's write end, read the
// state to EOF, CHECK_DEVICE_STATE.
func (d *Device) SaveState() ([]byte, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	reply, err := d.SetDeviceStateFD(TransferSave, PhaseStopped, int(w.Fd()))
	w.Close()
	if err != nil {
		return nil, err
	}
	if reply&0xff != 0 {
		return nil, fmt.Errorf("vmm: SET_DEVICE_STATE_FD(save) answered %#x", reply)
	}
	r.SetDeadline(time.Now().Add(d.opts.Timeout))
	state, rerr := io.ReadAll(r)
	if err := d.CheckDeviceState(); err != nil {
		return state, err
	}
	return state, rerr
}

// LoadState is the destination's side, before the rings start:
// SET_DEVICE_STATE_FD(load) with a pipe's read end, write state, close,
// CHECK_DEVICE_STATE.
func (d *Device) LoadState(state []byte) error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	reply, err := d.SetDeviceStateFD(TransferLoad, PhaseStopped, int(r.Fd()))
	r.Close()
	if err != nil {
		w.Close()
		return err
	}
	if reply&0xff != 0 {
		w.Close()
		return fmt.Errorf("vmm: SET_DEVICE_STATE_FD(load) answered %#x", reply)
	}
	w.SetDeadline(time.Now().Add(d.opts.Timeout))
	_, werr := w.Write(state)
	w.Close()
	if err := d.CheckDeviceState(); err != nil {
		return err
	}
	if werr != nil && !errors.Is(werr, unix.EPIPE) {
		return werr
	}
	return nil
}

// SetDeviceStateFD sends SET_DEVICE_STATE_FD with any direction, phase and
// fds, and returns the u64 answer (for malformed-message tests).
func (d *Device) SetDeviceStateFD(dir, phase uint32, fds ...int) (uint64, error) {
	m, err := d.Conn.Call(SetDeviceStateFd, le.AppendUint32(le.AppendUint32(nil, dir), phase), fds)
	if err != nil {
		return 0, err
	}
	m.CloseFds()
	return m.U64()
}

// CheckDeviceState sends CHECK_DEVICE_STATE; a non-zero answer is an error.
func (d *Device) CheckDeviceState() error {
	m, err := d.Conn.Call(CheckDeviceState, nil, nil)
	if err != nil {
		return err
	}
	m.CloseFds()
	v, err := m.U64()
	if err != nil {
		return err
	}
	if v != 0 {
		return &ReplyError{CheckDeviceState, v}
	}
	return nil
}
