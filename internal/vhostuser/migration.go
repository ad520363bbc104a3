package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Live migration, as QEMU ≥ 8.2 drives it for vhost-user-fs:
//
//   - Dirty logging (LOG_SHMFD, VHOST_F_LOG_ALL): SET_LOG_BASE hands us a
//     bitmap memfd; while LOG_ALL is acknowledged every page the daemon
//     writes into guest memory is logged (virtqueue.DirtyLog), so QEMU
//     copies it again. SET_VRING_ADDR with VHOST_VRING_F_LOG asks for the
//     used ring's writes too, and arrives on running rings.
//   - State transfer (DEVICE_STATE): once every ring is stopped
//     (GET_VRING_BASE), SET_DEVICE_STATE_FD gives us a pipe to write our
//     state into (source) or read it from (destination, before any ring
//     starts); CHECK_DEVICE_STATE then asks whether that went well. The
//     state itself is the DeviceState's business (the FUSE session and the
//     file system's inodes and handles).

// DeviceState is the part of the device's state that lives above the rings
// and must travel with a migrating VM. The FUSE server implements it.
type DeviceState interface {
	// LogAll is told when the front end turns dirty logging on (a
	// migration starts) or off (it ended or was cancelled). It runs on
	// the message loop and must return at once.
	LogAll(on bool)
	// SaveState writes the state to w. Every ring is stopped.
	SaveState(w io.Writer) error
	// LoadState reads a state from r, to its end, and installs it; on
	// error it installs nothing. No ring runs.
	LoadState(r io.Reader) error
}

// Vhost-user bits of migration (VHOST_F_LOG_ALL is with the features).
const (
	vringFlagLog = 1 << 0 // VHOST_VRING_F_LOG in SET_VRING_ADDR's flags

	// SET_DEVICE_STATE_FD's directions and its one phase.
	transferSave    = 0
	transferLoad    = 1
	phaseStopped    = 0
	stateReplyNoFD  = 1 << 8 // "no fd of mine: use yours"
	stateReplyError = 1      // any of bits 0-7
)

// maxLogSize bounds SET_LOG_BASE's bitmap: 1 bit per 4 KiB page, so 1 GiB
// of bitmap covers 32 TiB of guest memory.
const maxLogSize = 1 << 30

// transferStall bounds how long a state transfer waits for the pipe to
// move: a front end that neither reads nor closes it fails the transfer
// instead of holding the message loop in CHECK_DEVICE_STATE.
const transferStall = time.Minute

// migrationMessage handles the migration messages that, once negotiated,
// have an answer of their own, which a refusal must send too.
func (b *Backend) migrationMessage(m *Message) ([]byte, error) {
	switch m.Request {
	case reqSetDeviceStateFD:
		return b.setDeviceStateFD(m)
	case reqCheckDeviceState:
		return b.checkDeviceState()
	}
	// SET_LOG_BASE: answered exactly once, NEED_REPLY or not.
	if err := b.setLogBase(m); err != nil {
		return u64(1), err
	}
	return u64(0), nil
}

// setLogBase maps the front end's dirty bitmap (SET_LOG_BASE): payload u64
// size, u64 offset, one fd. A bitmap that replaces another is installed
// only once no ring writes into the old one: the front end reads and frees
// the old one as soon as it has our reply.
func (b *Backend) setLogBase(m *Message) error {
	if len(m.Payload) < 16 {
		return fmt.Errorf("set log base: payload of %d bytes, want 16", len(m.Payload))
	}
	if len(m.FDs) != 1 {
		return fmt.Errorf("set log base: %d fds, want 1", len(m.FDs))
	}
	size := binary.LittleEndian.Uint64(m.Payload[0:])
	offset := binary.LittleEndian.Uint64(m.Payload[8:])
	switch {
	case size == 0 || size%8 != 0 || size > maxLogSize:
		return fmt.Errorf("set log base: size %d, want a multiple of 8 in 8..%d", size, maxLogSize)
	case offset > maxLogSize || offset%uint64(os.Getpagesize()) != 0:
		return fmt.Errorf("set log base: offset %#x, want a multiple of the page size below %#x", offset, maxLogSize)
	}
	fd := m.FDs[0]
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("set log base: fstat: %w", err)
	}
	end := offset + size
	if st.Mode&unix.S_IFMT != unix.S_IFREG || uint64(st.Size) < end {
		// Touching a page beyond the end of the file would raise SIGBUS.
		return fmt.Errorf("set log base: fd holds %d bytes (mode %#o), log needs %d", st.Size, st.Mode&unix.S_IFMT, end)
	}
	data, err := unix.Mmap(fd, 0, int(end), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_NORESERVE)
	if err != nil {
		return fmt.Errorf("set log base: mmap %d bytes: %w", end, err)
	}
	b.dirty.Replace(data[offset:end:end], func([]byte) { unix.Munmap(data) })
	b.log.Debug("dirty log mapped", "size", size, "offset", offset)
	return nil
}

// setLogging turns logging on or off, telling the device state when it
// changes.
func (b *Backend) setLogging(on, was bool) {
	b.dirty.SetActive(on)
	if on == was {
		return
	}
	b.log.Info("dirty logging", "on", on, "log_size", b.dirty.Size())
	if !on {
		if n := b.dirty.Beyond(); n > 0 {
			b.log.Warn("dirty log: pages written beyond the log were not logged", "pages", n)
		}
		if n := b.dirty.Unlogged(); n > 0 {
			b.log.Warn("dirty log: writes made before a log was mapped were not logged", "writes", n)
		}
	}
	if b.cfg.State != nil && b.proto&protoDeviceState != 0 {
		b.cfg.State.LogAll(on)
	}
}

// transfer is one SET_DEVICE_STATE_FD stream, run by its own goroutine:
// the front end reads our reply before it touches the pipe.
type transfer struct {
	dir  uint32
	f    *os.File
	done chan struct{}
	err  error // set before done closes
}

// setDeviceStateFD starts a state transfer (SET_DEVICE_STATE_FD): payload
// u32 direction, u32 phase; one fd, the pipe. The reply says that we use
// the front end's fd.
func (b *Backend) setDeviceStateFD(m *Message) ([]byte, error) {
	fail := u64(stateReplyError | stateReplyNoFD)
	if len(m.Payload) < 8 {
		return fail, fmt.Errorf("set device state fd: payload of %d bytes, want 8", len(m.Payload))
	}
	dir := binary.LittleEndian.Uint32(m.Payload[0:])
	phase := binary.LittleEndian.Uint32(m.Payload[4:])
	switch {
	case len(m.FDs) != 1:
		return fail, fmt.Errorf("set device state fd: %d fds, want 1", len(m.FDs))
	case dir != transferSave && dir != transferLoad:
		return fail, fmt.Errorf("set device state fd: unknown direction %d", dir)
	case phase != phaseStopped:
		return fail, fmt.Errorf("set device state fd: unknown phase %d", phase)
	case b.transfer != nil:
		return fail, errors.New("set device state fd: a transfer is already in progress")
	}
	for _, r := range b.rings {
		if r != nil && r.started() {
			return fail, fmt.Errorf("set device state fd: ring %d is running", r.index)
		}
	}
	fd := m.takeFD()
	// Non-blocking, the pipe is pollable: a stalled transfer can time out.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return fail, fmt.Errorf("set device state fd: %w", err)
	}
	t := &transfer{dir: dir, f: os.NewFile(uintptr(fd), "device-state"), done: make(chan struct{})}
	b.transfer = t
	state, log, stall := b.cfg.State, b.log, b.transferStall
	go func() {
		defer close(t.done)
		start := time.Now()
		if dir == transferSave {
			w := &stallWriter{f: t.f, stall: stall}
			t.err = state.SaveState(w)
			if cerr := t.f.Close(); t.err == nil && cerr != nil {
				t.err = cerr
			}
			log.Info("device state saved", "bytes", w.n, "took", time.Since(start), "err", t.err)
			return
		}
		r := &stallReader{f: t.f, stall: stall}
		t.err = state.LoadState(r)
		t.f.Close()
		log.Info("device state loaded", "bytes", r.n, "took", time.Since(start), "err", t.err)
	}()
	return u64(stateReplyNoFD), nil
}

// checkDeviceState answers CHECK_DEVICE_STATE: 0 when the last transfer
// succeeded. It waits for the transfer to end.
func (b *Backend) checkDeviceState() ([]byte, error) {
	t := b.transfer
	if t == nil {
		return u64(stateReplyError), errors.New("check device state: no transfer")
	}
	b.finishTransfer()
	if t.err != nil {
		what := "save"
		if t.dir == transferLoad {
			what = "load"
		}
		return u64(stateReplyError), fmt.Errorf("check device state: %s: %w", what, t.err)
	}
	return u64(0), nil
}

// finishTransfer waits for a transfer in progress to end and forgets it.
// Rings do not start while one runs: a load installs what they serve.
func (b *Backend) finishTransfer() {
	if t := b.transfer; t != nil {
		<-t.done
		b.transfer = nil
	}
}

// abortTransfer ends a transfer in progress at once (the front end is
// gone or reset the device): closing the pipe fails its I/O.
func (b *Backend) abortTransfer() {
	if t := b.transfer; t != nil {
		t.f.SetDeadline(time.Now())
		b.finishTransfer()
	}
}

// stallReader and stallWriter fail an I/O on the pipe that makes no
// progress for stall, and count the bytes moved.
type stallReader struct {
	f     *os.File
	stall time.Duration
	n     int64
}

func (r *stallReader) Read(p []byte) (int, error) {
	r.f.SetReadDeadline(time.Now().Add(r.stall))
	n, err := r.f.Read(p)
	r.n += int64(n)
	return n, err
}

type stallWriter struct {
	f     *os.File
	stall time.Duration
	n     int64
}

func (w *stallWriter) Write(p []byte) (int, error) {
	var done int
	for done < len(p) {
		w.f.SetWriteDeadline(time.Now().Add(w.stall))
		n, err := w.f.Write(p[done:])
		done += n
		w.n += int64(n)
		if err != nil && (n == 0 || !errors.Is(err, os.ErrDeadlineExceeded)) {
			return done, err
		}
	}
	return done, nil
}
