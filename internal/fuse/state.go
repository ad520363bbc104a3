package fuse

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// Live migration (vhost-user VHOST_USER_PROTOCOL_F_DEVICE_STATE). The
// source saves the state with every ring stopped; the destination, a
// daemon that never saw INIT, loads it before any ring runs, and then
// serves the guest's FUSE session, which sends no new INIT.
//
// The stream (format version 1), integers little-endian:
//
//	magic     8 bytes  "GVFSFUSE"
//	version   u32      1
//	flags     u32      bit 0: a session follows; other bits 0
//	minor     u32      negotiated protocol minor (7.minor)
//	caps      u64      negotiated gofuse.CAP_* bits, flags | flags2<<32
//	max_write u32      told to the guest at INIT
//	max_pages u32      told to the guest with CAP_MAX_PAGES, else 0
//	readahead u32      the guest's max_readahead
//	crc       u32      CRC-32C (Castagnoli) of the 40 bytes above
//	then, with a session, the file system's section to end of stream
//	(MigratableFileSystem.SaveState); without one, end of stream.
//
// Without a session (before the guest mounted, or after DESTROY) the
// fields from minor on are 0. The header is read with exact-size reads, so
// the file system's decoder gets the rest of the stream untouched.

// MigratableFileSystem is a FileSystem whose session can move to another
// daemon on the same shared directory.
type MigratableFileSystem interface {
	FileSystem
	// PrepareMigration starts background work for a coming SaveState (a
	// migration starts); CancelMigration stops it (the migration was
	// cancelled, or completed and the VM resumed here). Both return at
	// once.
	PrepareMigration()
	CancelMigration()
	// SaveState writes the file system's state of the session; no
	// request runs meanwhile.
	SaveState(w io.Writer) error
	// LoadState reads a state written by SaveState from r, to end of
	// stream, and installs it as a session with capabilities caps (as
	// Init(caps) would, plus the restored state), replacing the file
	// system's session. On error it installs nothing and leaks nothing.
	// No request runs meanwhile.
	LoadState(r io.Reader, caps uint64) error
}

const (
	stateMagic      = "GVFSFUSE"
	stateVersion    = 1
	stateHeaderSize = 44
	stateHasSession = 1
	// maxMaxWrite bounds a restored max_write: 65535 pages of 4 KiB, the
	// most a request can hold.
	maxMaxWrite = 65535 * 4096
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrNotMigratable is returned by SaveState and LoadState when the file
// system does not implement MigratableFileSystem.
var ErrNotMigratable = errors.New("the file system does not support migration")

// SessionInfo describes the FUSE session.
type SessionInfo struct {
	Minor        uint32 // protocol 7.Minor
	Caps         uint64 // gofuse.CAP_* bits, flags | flags2<<32
	MaxWrite     uint32
	MaxPages     uint16 // 0 without CAP_MAX_PAGES
	MaxReadahead uint32
}

// Session returns the current session; false before INIT and after
// DESTROY.
func (s *Server) Session() (SessionInfo, bool) {
	ss := s.sess.Load()
	if ss == nil {
		return SessionInfo{}, false
	}
	return SessionInfo{Minor: ss.minor, Caps: ss.caps, MaxWrite: ss.maxWrite, MaxPages: ss.maxPages,
		MaxReadahead: ss.maxReadahead}, true
}

// LogAll is told when the front end turns dirty logging on (a migration
// starts) or off (it was cancelled, or completed and the VM resumed on the
// source). It runs on the vhost-user message loop and returns at once: it
// only starts or cancels the file system's background work.
func (s *Server) LogAll(on bool) {
	m, ok := s.fs.(MigratableFileSystem)
	if !ok {
		return
	}
	if on {
		m.PrepareMigration()
	} else {
		m.CancelMigration()
	}
}

// SaveState writes everything the guest's FUSE session depends on to w:
// the session INIT negotiated, then the file system's state. Call it with
// every ring stopped (no request runs).
func (s *Server) SaveState(w io.Writer) error {
	m, ok := s.fs.(MigratableFileSystem)
	if !ok {
		return ErrNotMigratable
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var h [stateHeaderSize]byte
	copy(h[:], stateMagic)
	binary.LittleEndian.PutUint32(h[8:], stateVersion)
	ss := s.sess.Load()
	if ss != nil {
		binary.LittleEndian.PutUint32(h[12:], stateHasSession)
		binary.LittleEndian.PutUint32(h[16:], ss.minor)
		binary.LittleEndian.PutUint64(h[20:], ss.caps)
		binary.LittleEndian.PutUint32(h[28:], ss.maxWrite)
		binary.LittleEndian.PutUint32(h[32:], uint32(ss.maxPages))
		binary.LittleEndian.PutUint32(h[36:], ss.maxReadahead)
	}
	binary.LittleEndian.PutUint32(h[40:], crc32.Checksum(h[:40], castagnoli))
	if _, err := w.Write(h[:]); err != nil {
		return fmt.Errorf("write FUSE session state: %w", err)
	}
	if ss == nil {
		return nil
	}
	if err := m.SaveState(w); err != nil {
		return fmt.Errorf("save file system state: %w", err)
	}
	return nil
}

// LoadState reads a state written by SaveState (of this or an older
// format version) from r, to end of stream, and installs it, replacing
// whatever session the server had. Call it before any ring runs. On error
// nothing is installed: the server and the file system stay as they were.
func (s *Server) LoadState(r io.Reader) error {
	m, ok := s.fs.(MigratableFileSystem)
	if !ok {
		return ErrNotMigratable
	}
	var h [stateHeaderSize]byte
	if err := readState(r, h[:12], "header"); err != nil {
		return err
	}
	if string(h[:8]) != stateMagic {
		return fmt.Errorf("not a govirtiofsd migration state (magic %q)", h[:8])
	}
	if v := binary.LittleEndian.Uint32(h[8:]); v != stateVersion {
		return fmt.Errorf("migration state version %d is not supported (this daemon reads %d)", v, stateVersion)
	}
	if err := readState(r, h[12:], "header"); err != nil {
		return err
	}
	if got, want := binary.LittleEndian.Uint32(h[40:]), crc32.Checksum(h[:40], castagnoli); got != want {
		return fmt.Errorf("FUSE session state: checksum %#08x, computed %#08x", got, want)
	}
	ss, err := s.decodeSession(h[:])
	if err != nil {
		return fmt.Errorf("FUSE session state: %w", err)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if ss == nil {
		var one [1]byte
		switch n, err := io.ReadFull(r, one[:]); {
		case n > 0:
			return fmt.Errorf("FUSE session state: bytes after a state without a session")
		case err != io.EOF:
			return fmt.Errorf("read migration state: %w", err)
		}
		s.sess.Store(nil)
		s.fs.Destroy()
		s.log.Info("FUSE migration state loaded: no session")
		return nil
	}
	if err := m.LoadState(r, ss.caps); err != nil {
		return fmt.Errorf("load file system state: %w", err)
	}
	s.sess.Store(ss)
	s.log.Info("FUSE session restored by migration", "negotiated", versionString(KernelVersion, ss.minor),
		"flags", ss.caps, "max_write", ss.maxWrite, "max_pages", ss.maxPages)
	return nil
}

// readState fills b from r, telling a short stream apart.
func readState(r io.Reader, b []byte, what string) error {
	if _, err := io.ReadFull(r, b); err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return fmt.Errorf("truncated migration state: it ends in the %s", what)
		}
		return fmt.Errorf("read migration state: %w", err)
	}
	return nil
}

// decodeSession checks the session of a header: nil for none. A session
// this daemon cannot serve as negotiated (a protocol minor or capability it
// lacks, or one its file system's options leave off) is refused.
func (s *Server) decodeSession(h []byte) (*session, error) {
	flags := binary.LittleEndian.Uint32(h[12:])
	ss := &session{
		minor:        binary.LittleEndian.Uint32(h[16:]),
		caps:         binary.LittleEndian.Uint64(h[20:]),
		maxWrite:     binary.LittleEndian.Uint32(h[28:]),
		maxReadahead: binary.LittleEndian.Uint32(h[36:]),
	}
	pages := binary.LittleEndian.Uint32(h[32:])
	switch {
	case flags&^stateHasSession != 0:
		return nil, fmt.Errorf("unknown flags %#x", flags)
	case flags == 0:
		for _, b := range h[16:40] {
			if b != 0 {
				return nil, fmt.Errorf("session fields set in a state without a session")
			}
		}
		return nil, nil
	case ss.minor < MinKernelMinor || ss.minor > KernelMinor:
		return nil, fmt.Errorf("protocol 7.%d is not served here (7.%d to 7.%d)", ss.minor, MinKernelMinor, KernelMinor)
	case ss.caps&^allowedCaps != 0:
		return nil, fmt.Errorf("capabilities %#x are unknown to this daemon", ss.caps&^allowedCaps)
	case ss.caps&^(s.fs.Capabilities()|serverCaps) != 0:
		return nil, fmt.Errorf("capabilities %#x were negotiated but are off here (configure the destination as the source)",
			ss.caps&^(s.fs.Capabilities()|serverCaps))
	case ss.maxWrite == 0 || ss.maxWrite > maxMaxWrite:
		return nil, fmt.Errorf("max_write %d out of range", ss.maxWrite)
	case pages > 0xffff || (pages == 0) != (ss.caps&gofuse.CAP_MAX_PAGES == 0):
		return nil, fmt.Errorf("max_pages %d does not match the capabilities", pages)
	}
	ss.maxPages = uint16(pages)
	return ss, nil
}
