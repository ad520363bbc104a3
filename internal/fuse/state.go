package fuse

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// Live migration (vhost-user VHOST_USER_PROTOCOL_F_DEVICE_STATE). The
// source saves the state with every ring stopped; the destination, a
// daemon that never saw INIT, loads it before any ring runs, and then
// serves the guest's FUSE session, which sends no new INIT.
//
// The stream is the file system's (internal/passthrough/migstate/stream.go): the
// Rust virtiofsd's message, which a Rust destination loads, then our
// trailer. The server owns one record in it, the session INIT negotiated,
// which it hands to MigratableFileSystem.SaveState as opaque bytes and gets
// back in LoadState's restore callback: nil when the stream has no trailer,
// i.e. the Rust daemon wrote it, and the session must be rebuilt as that
// daemon negotiates it (rustSession).
//
// The session record (version 1), integers little-endian, 32 bytes:
//
//	version   u32  1
//	flags     u32  bit 0: a session; other bits 0
//	minor     u32  negotiated protocol minor (7.minor)
//	caps      u64  negotiated gofuse.CAP_* bits, flags | flags2<<32
//	max_write u32  told to the guest at INIT
//	max_pages u32  told to the guest with CAP_MAX_PAGES, else 0
//	readahead u32  the guest's max_readahead
//
// Without a session (before the guest mounted, or after DESTROY) the fields
// from minor on are 0.

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
	// SaveState writes the whole migration stream to w, carrying session
	// (the server's record, opaque to the file system) with the file
	// system's state of the session; no request runs meanwhile.
	SaveState(w io.Writer, session []byte) error
	// LoadState reads a stream to its end, one SaveState wrote or one of
	// the Rust virtiofsd, and installs it, replacing the file system's
	// session. Once the stream is decoded and checked, and before it
	// opens anything, it calls restore with the session record it
	// carried (nil: none, a Rust daemon's stream), whether the guest had
	// a session, and the options the Rust format records as negotiated,
	// as CAP_* bits (WRITEBACK_CACHE, SUBMOUNTS, POSIX_ACL|DONT_MASK|
	// SETXATTR_EXT, CREATE_SUPP_GROUP). restore returns the capabilities
	// to install the session with (as Init(caps) would) or an error, which
	// fails the load. On error the file system installs nothing and
	// leaks nothing. No request runs meanwhile.
	LoadState(r io.Reader, restore func(session []byte, mounted bool, negotiated uint64) (caps uint64, err error)) error
}

const (
	sessionRecordVersion = 1
	sessionRecordSize    = 32
	sessionPresent       = 1
	// maxMaxWrite bounds a restored max_write: 65535 pages of 4 KiB, the
	// most a request can hold.
	maxMaxWrite = 65535 * 4096

	// negotiatedBits are the capabilities the Rust format's negotiated
	// options (writeback, announce_submounts, posix_acl,
	// sup_group_extension) record; a session of ours must agree with them.
	negotiatedBits = gofuse.CAP_WRITEBACK_CACHE | gofuse.CAP_SUBMOUNTS | gofuse.CAP_POSIX_ACL |
		gofuse.CAP_CREATE_SUPP_GROUP
)

// What the Rust virtiofsd 1.13 negotiates (src/server.rs, fn init, and
// src/passthrough/mod.rs, fn init), and what Linux 6.12 offers it.
const (
	// rustMinor is its KERNEL_MINOR_VERSION: it answers 7.38 whatever the
	// guest speaks (6.12 speaks 7.41).
	rustMinor = 38
	// rustMaxWrite is its MAX_BUFFER_SIZE; max_pages is that in 4 KiB
	// pages.
	rustMaxWrite = 1 << 20
	rustMaxPages = rustMaxWrite / 4096
	// linuxReadahead is the max_readahead Linux 6.12 sends for virtio-fs
	// (seen on the wire), which the Rust daemon echoes.
	linuxReadahead = 128 << 10

	// rustSupported is the set its server always accepts from the guest.
	rustSupported = gofuse.CAP_ASYNC_READ | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_BIG_WRITES |
		gofuse.CAP_AUTO_INVAL_DATA | gofuse.CAP_ASYNC_DIO | gofuse.CAP_IOCTL_DIR | gofuse.CAP_ATOMIC_O_TRUNC |
		gofuse.CAP_MAX_PAGES | gofuse.CAP_SUBMOUNTS | gofuse.CAP_INIT_EXT | gofuse.CAP_CREATE_SUPP_GROUP |
		gofuse.CAP_ALLOW_IDMAP
	// rustOptional is what its file system adds by its options:
	// readdirplus (on unless --no-readdirplus or cache=never),
	// --writeback, --killpriv-v2, --posix-acl, --security-label,
	// --allow-mmap.
	rustOptional = gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO | gofuse.CAP_WRITEBACK_CACHE |
		gofuse.CAP_HANDLE_KILLPRIV_V2 | gofuse.CAP_POSIX_ACL | gofuse.CAP_DONT_MASK | gofuse.CAP_SETXATTR_EXT |
		gofuse.CAP_SECURITY_CTX | gofuse.CAP_DIRECT_IO_ALLOW_MMAP

	// linuxInitFlags is what Linux 6.12 offers at FUSE_INIT for a
	// virtio-fs mount without DAX (fs/fuse/inode.c, fuse_send_init;
	// SUBMOUNTS because virtio-fs sets auto_submounts).
	linuxInitFlags = gofuse.CAP_ASYNC_READ | gofuse.CAP_POSIX_LOCKS | gofuse.CAP_ATOMIC_O_TRUNC |
		gofuse.CAP_EXPORT_SUPPORT | gofuse.CAP_BIG_WRITES | gofuse.CAP_DONT_MASK | gofuse.CAP_SPLICE_WRITE |
		gofuse.CAP_SPLICE_MOVE | gofuse.CAP_SPLICE_READ | gofuse.CAP_FLOCK_LOCKS | gofuse.CAP_IOCTL_DIR |
		gofuse.CAP_AUTO_INVAL_DATA | gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO | gofuse.CAP_ASYNC_DIO |
		gofuse.CAP_WRITEBACK_CACHE | gofuse.CAP_NO_OPEN_SUPPORT | gofuse.CAP_PARALLEL_DIROPS |
		gofuse.CAP_HANDLE_KILLPRIV | gofuse.CAP_POSIX_ACL | gofuse.CAP_ABORT_ERROR | gofuse.CAP_MAX_PAGES |
		gofuse.CAP_CACHE_SYMLINKS | gofuse.CAP_NO_OPENDIR_SUPPORT | gofuse.CAP_EXPLICIT_INVAL_DATA |
		gofuse.CAP_SUBMOUNTS | gofuse.CAP_HANDLE_KILLPRIV_V2 | gofuse.CAP_SETXATTR_EXT | gofuse.CAP_INIT_EXT |
		gofuse.CAP_SECURITY_CTX | gofuse.CAP_CREATE_SUPP_GROUP | gofuse.CAP_HAS_EXPIRE_ONLY |
		gofuse.CAP_DIRECT_IO_ALLOW_MMAP | gofuse.CAP_NO_EXPORT_SUPPORT | gofuse.CAP_HAS_RESEND |
		gofuse.CAP_ALLOW_IDMAP

	// restoreOnlyCaps may be in a session a Rust daemon negotiated,
	// which this server never negotiates itself but serves: IOCTL_DIR
	// (IOCTL is ENOSYS for directories as for files). (ALLOW_IDMAP, once
	// restore-only, is negotiated since protocol 7.41 was: serverCaps.)
	restoreOnlyCaps = gofuse.CAP_IOCTL_DIR
)

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
// the file system's state, with the session INIT negotiated. Call it with
// every ring stopped (no request runs).
func (s *Server) SaveState(w io.Writer) error {
	m, err := s.lockMigratable()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	ss := s.sess.Load()
	s.warnRust(ss)
	if err = m.SaveState(w, encodeSession(ss)); err != nil {
		return fmt.Errorf("save migration state: %w", err)
	}
	return nil
}

// lockMigratable returns the file system as a MigratableFileSystem with
// s.mu held, for the caller to unlock, or ErrNotMigratable.
func (s *Server) lockMigratable() (MigratableFileSystem, error) {
	m, ok := s.fs.(MigratableFileSystem)
	if !ok {
		return nil, ErrNotMigratable
	}
	s.mu.Lock()
	return m, nil
}

func encodeSession(ss *session) []byte {
	b := make([]byte, sessionRecordSize)
	binary.LittleEndian.PutUint32(b[0:], sessionRecordVersion)
	if ss != nil {
		binary.LittleEndian.PutUint32(b[4:], sessionPresent)
		binary.LittleEndian.PutUint32(b[8:], ss.minor)
		binary.LittleEndian.PutUint64(b[12:], ss.caps)
		binary.LittleEndian.PutUint32(b[20:], ss.maxWrite)
		binary.LittleEndian.PutUint32(b[24:], uint32(ss.maxPages))
		binary.LittleEndian.PutUint32(b[28:], ss.maxReadahead)
	}
	return b
}

// rustHarmless are capabilities of ours the Rust daemon does not
// negotiate that do not matter to it: EXPORT_SUPPORT (the guest looks up
// "." and ".." only to export the mount over NFS, which its LOOKUP also
// answers) and HAS_EXPIRE_ONLY (the kernel's, for notifications neither
// daemon sends).
const rustHarmless = gofuse.CAP_EXPORT_SUPPORT | gofuse.CAP_HAS_EXPIRE_ONLY

// warnRust logs what of the session a Rust virtiofsd (1.13 or 1.14, both
// serve 7.38) destination would not serve: the stream loads there, but the
// guest keeps what it negotiated here (POSIX and flock locks: it answers
// ENOSYS). A protocol minor above 7.38 is no obstacle: 7.39 to 7.45 changed
// no request or reply the Rust daemon serves, only added opcodes (STATX,
// COPY_FILE_RANGE_64), which it answers ENOSYS, and after which Linux falls
// back (to GETATTR, to COPY_FILE_RANGE), and flags it either negotiates
// too (ALLOW_IDMAP) or that this server never negotiates; the save logs
// that at info level.
func (s *Server) warnRust(ss *session) {
	if ss == nil {
		return
	}
	var lacks []string
	if c := ss.caps &^ (rustSupported | rustOptional | rustHarmless); c != 0 {
		lacks = append(lacks, "capabilities "+capNames(c))
	}
	if ss.maxWrite > rustMaxWrite {
		lacks = append(lacks, fmt.Sprintf("max_write %d (it refuses requests beyond %d)", ss.maxWrite, rustMaxWrite))
	}
	if len(lacks) > 0 {
		s.log.Warn("FUSE session: a Rust virtiofsd destination would not serve "+strings.Join(lacks, ", "),
			"flags", ss.caps)
	}
	if ss.minor > rustMinor {
		s.log.Info(fmt.Sprintf("FUSE session at protocol 7.%d: a Rust virtiofsd destination (7.%d) answers COPY_FILE_RANGE_64 and STATX with ENOSYS, and the guest falls back to COPY_FILE_RANGE and GETATTR", ss.minor, rustMinor))
	}
}

// capNames names the capabilities in c that a session of ours may hold
// beyond the Rust daemon's, and the others by value.
func capNames(c uint64) string {
	names := []struct {
		bit  uint64
		name string
	}{
		{gofuse.CAP_POSIX_LOCKS, "POSIX_LOCKS (locks fail there)"}, {gofuse.CAP_FLOCK_LOCKS, "FLOCK_LOCKS (flock fails there)"},
	}
	var out []string
	for _, n := range names {
		if c&n.bit != 0 {
			out = append(out, n.name)
			c &^= n.bit
		}
	}
	if c != 0 {
		out = append(out, fmt.Sprintf("%#x", c))
	}
	return strings.Join(out, "|")
}

// LoadState reads a migration stream from r, to its end, one this daemon
// or the Rust virtiofsd wrote, and installs it, replacing whatever session
// the server had. Call it before any ring runs. On error nothing is
// installed: the server and the file system stay as they were.
func (s *Server) LoadState(r io.Reader) error {
	m, err := s.lockMigratable()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	var ss *session
	rust := false
	err = m.LoadState(r, func(rec []byte, mounted bool, negotiated uint64) (uint64, error) {
		var err error
		if rec == nil {
			rust = true
			ss, err = s.rustSession(mounted, negotiated)
		} else {
			ss, err = s.decodeSession(rec, mounted, negotiated)
		}
		if err != nil || ss == nil {
			return 0, err
		}
		return ss.caps, nil
	})
	if err != nil {
		return fmt.Errorf("load migration state: %w", err)
	}
	s.sess.Store(ss)
	switch {
	case ss == nil:
		s.log.Info("FUSE migration state loaded: no session")
	case rust:
		s.log.Info("FUSE session rebuilt for a Rust virtiofsd state, which carries no INIT parameters: assumed as virtiofsd 1.13 negotiates with Linux 6.12",
			"negotiated", versionString(KernelVersion, ss.minor), "flags", ss.caps, "max_write", ss.maxWrite,
			"max_pages", ss.maxPages, "max_readahead", ss.maxReadahead)
	default:
		s.log.Info("FUSE session restored by migration", "negotiated", versionString(KernelVersion, ss.minor),
			"flags", ss.caps, "max_write", ss.maxWrite, "max_pages", ss.maxPages)
	}
	return nil
}

// rustSession rebuilds the session of a state the Rust virtiofsd 1.13 saved,
// as it negotiates with a Linux 6.12 guest: its own capabilities, those
// its options add (the ones the stream records, the others assumed as this
// daemon's own: readdirplus, killpriv_v2), within what 6.12 offers. The
// guest must have negotiated nothing this server cannot serve.
func (s *Server) rustSession(mounted bool, negotiated uint64) (*session, error) {
	if !mounted {
		return nil, nil
	}
	fsCaps := s.fs.Capabilities()
	// The stream does not say whether the source had --security-label:
	// as for readdirplus, the destination is assumed configured as the
	// source was, and its guest then sends security contexts.
	want := fsCaps&(gofuse.CAP_READDIRPLUS|gofuse.CAP_READDIRPLUS_AUTO|gofuse.CAP_HANDLE_KILLPRIV_V2|gofuse.CAP_SECURITY_CTX) |
		negotiated&(gofuse.CAP_WRITEBACK_CACHE|gofuse.CAP_POSIX_ACL|gofuse.CAP_DONT_MASK|gofuse.CAP_SETXATTR_EXT)
	caps := linuxInitFlags & (rustSupported | want)
	// The stream says whether the guest offered CREATE_SUPP_GROUP
	// (sup_group_extension), and whether the daemon announced submounts:
	// SUBMOUNTS is negotiated either way, but is only this server's
	// business (ATTR_SUBMOUNT) when announced.
	caps = caps&^(gofuse.CAP_CREATE_SUPP_GROUP|gofuse.CAP_SUBMOUNTS) |
		negotiated&(gofuse.CAP_CREATE_SUPP_GROUP|gofuse.CAP_SUBMOUNTS)
	if c := caps &^ (fsCaps | serverCaps | restoreOnlyCaps); c != 0 {
		return nil, fmt.Errorf("the Rust virtiofsd's session has capabilities %#x that are off here (configure the destination as the source)", c)
	}
	if c := caps &^ (allowedCaps | restoreOnlyCaps); c != 0 {
		return nil, fmt.Errorf("the Rust virtiofsd's session has capabilities %#x that this daemon does not serve", c)
	}
	return &session{minor: rustMinor, caps: caps, maxWrite: rustMaxWrite, maxPages: rustMaxPages,
		maxReadahead: linuxReadahead}, nil
}

// decodeSession checks a session record: nil for none. A session this
// daemon cannot serve as negotiated (a protocol minor or capability it
// lacks, or one its file system's options leave off), or that disagrees
// with the file system's state, is refused.
func (s *Server) decodeSession(b []byte, mounted bool, negotiated uint64) (*session, error) {
	if len(b) != sessionRecordSize {
		return nil, fmt.Errorf("FUSE session record of %d bytes (want %d)", len(b), sessionRecordSize)
	}
	if v := binary.LittleEndian.Uint32(b); v != sessionRecordVersion {
		return nil, fmt.Errorf("FUSE session record version %d is not supported (this daemon reads %d)", v, sessionRecordVersion)
	}
	flags := binary.LittleEndian.Uint32(b[4:])
	ss := &session{
		minor:        binary.LittleEndian.Uint32(b[8:]),
		caps:         binary.LittleEndian.Uint64(b[12:]),
		maxWrite:     binary.LittleEndian.Uint32(b[20:]),
		maxReadahead: binary.LittleEndian.Uint32(b[28:]),
	}
	pages := binary.LittleEndian.Uint32(b[24:])
	switch {
	case flags&^sessionPresent != 0:
		return nil, fmt.Errorf("FUSE session record: unknown flags %#x", flags)
	case (flags == sessionPresent) != mounted:
		return nil, fmt.Errorf("the FUSE session record (session: %v) disagrees with the file system's state (mounted: %v)",
			flags == sessionPresent, mounted)
	case flags == 0:
		for _, c := range b[8:] {
			if c != 0 {
				return nil, fmt.Errorf("FUSE session record: session fields set without a session")
			}
		}
		return nil, nil
	case ss.minor < MinKernelMinor || ss.minor > KernelMinor:
		return nil, fmt.Errorf("FUSE session: protocol 7.%d is not served here (7.%d to 7.%d)", ss.minor, MinKernelMinor, KernelMinor)
	case ss.caps&^(allowedCaps|restoreOnlyCaps) != 0:
		return nil, fmt.Errorf("FUSE session: capabilities %#x are unknown to this daemon", ss.caps&^(allowedCaps|restoreOnlyCaps))
	case ss.caps&^(s.fs.Capabilities()|serverCaps|restoreOnlyCaps) != 0:
		return nil, fmt.Errorf("FUSE session: capabilities %#x were negotiated but are off here (configure the destination as the source)",
			ss.caps&^(s.fs.Capabilities()|serverCaps|restoreOnlyCaps))
	case ss.caps&negotiatedBits != negotiated&negotiatedBits:
		return nil, fmt.Errorf("FUSE session: capabilities %#x disagree with the file system's negotiated options %#x",
			ss.caps&negotiatedBits, negotiated&negotiatedBits)
	case ss.maxWrite == 0 || ss.maxWrite > maxMaxWrite:
		return nil, fmt.Errorf("FUSE session: max_write %d out of range", ss.maxWrite)
	case pages > 0xffff || (pages == 0) != (ss.caps&gofuse.CAP_MAX_PAGES == 0):
		return nil, fmt.Errorf("FUSE session: max_pages %d does not match the capabilities", pages)
	}
	ss.maxPages = uint16(pages)
	return ss, nil
}
