package fuse

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// migFS is a fake file system that migrates. Its stream is
//
//	"FAKE", mounted (1 byte), negotiated (u64), then the session record
//
// and one without a record after the negotiated options stands for a Rust
// daemon's.
type migFS struct {
	*fakeFS
	mounted    bool   // the file system has a session (a root)
	negotiated uint64 // the options the Rust format would record
	loadErr    error
	loadCaps   uint64
	loads      int
	prepares   int
	cancels    int
	restored   bool // restore was called
}

const fakeMagic = "FAKE"

func (m *migFS) PrepareMigration() { m.prepares++ }
func (m *migFS) CancelMigration()  { m.cancels++ }
func (m *migFS) SaveState(w io.Writer, session []byte) error {
	_, err := w.Write(fakeStream(m.mounted, m.negotiated, session))
	return err
}

func fakeStream(mounted bool, negotiated uint64, session []byte) []byte {
	b := []byte(fakeMagic)
	if mounted {
		b = append(b, 1)
	} else {
		b = append(b, 0)
	}
	b = binary.LittleEndian.AppendUint64(b, negotiated)
	return append(b, session...)
}

func (m *migFS) LoadState(r io.Reader, restore func([]byte, bool, uint64) (uint64, error)) error {
	b, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	if len(b) < 13 || string(b[:4]) != fakeMagic || b[4] > 1 {
		return errors.New("bad fake state")
	}
	var rec []byte
	if len(b) > 13 {
		rec = b[13:]
	}
	m.restored = true
	caps, err := restore(rec, b[4] == 1, binary.LittleEndian.Uint64(b[5:]))
	if err != nil {
		return err
	}
	if m.loadErr != nil {
		return m.loadErr
	}
	m.loads++
	m.loadCaps = caps
	m.mounted = b[4] == 1
	return nil
}

func newMigFS() *migFS { return &migFS{fakeFS: newFakeFS()} }

// migSession is a server on a migFS whose session INIT started.
func migSession(t testing.TB) (*Server, *migFS) {
	t.Helper()
	m := newMigFS()
	s, _ := newSession(t, m.fakeFS)
	s.fs = m // the session was negotiated with the same capabilities
	m.mounted = true
	ss, _ := s.Session()
	m.negotiated = ss.Caps & negotiatedBits
	return s, m
}

func saveServer(t testing.TB, s *Server) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := s.SaveState(&b); err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	return b.Bytes()
}

func getattrErrno(t *testing.T, q *Queue) int32 {
	return errnoOf(serve(t, q, mkreq(OpGetattr, 5, make([]byte, 16), nil, nil), 0, 16+attrOutSize, 0))
}

func TestStateRoundTrip(t *testing.T) {
	s, _ := migSession(t)
	want, ok := s.Session()
	if !ok || want.Minor != 38 || want.MaxWrite != DefaultMaxWrite || want.MaxPages != DefaultMaxPages {
		t.Fatalf("source session %+v %v", want, ok)
	}
	b := saveServer(t, s)
	if len(b) != 13+sessionRecordSize || string(b[:4]) != fakeMagic {
		t.Fatalf("stream % x", b)
	}
	rec := b[13:]
	if binary.LittleEndian.Uint32(rec) != 1 || binary.LittleEndian.Uint32(rec[4:]) != 1 ||
		binary.LittleEndian.Uint32(rec[8:]) != 38 || binary.LittleEndian.Uint64(rec[12:]) != want.Caps ||
		binary.LittleEndian.Uint32(rec[20:]) != DefaultMaxWrite || binary.LittleEndian.Uint32(rec[24:]) != DefaultMaxPages ||
		binary.LittleEndian.Uint32(rec[28:]) != 128<<10 {
		t.Fatalf("session record % x", rec)
	}

	dst := newMigFS()
	// The destination's own options do not matter: the guest was told
	// the source's max_write.
	d := NewServer(dst, ServerOptions{MaxWrite: 4096}, debugLogger())
	q := d.Queue(0)
	if e := getattrErrno(t, q); e != -int32(syscall.EIO) {
		t.Fatalf("GETATTR before the load: %d", e)
	}
	if err := d.LoadState(bytes.NewReader(b)); err != nil {
		t.Fatalf("LoadState: %v", err)
	}
	got, ok := d.Session()
	if !ok || got != want {
		t.Fatalf("restored session %+v, want %+v", got, want)
	}
	if dst.loads != 1 || dst.loadCaps != want.Caps {
		t.Fatalf("file system load: %d, caps %#x", dst.loads, dst.loadCaps)
	}
	// Served without INIT.
	if e := getattrErrno(t, q); e != 0 {
		t.Fatalf("GETATTR after the load: %d", e)
	}
	for _, c := range dst.lastCalls() {
		if c.Op == "Init" {
			t.Fatal("Init called")
		}
	}
	w := make([]byte, 8192)
	wreq := mkreq(OpWrite, 7, argBytes(gofuse.WriteIn{Size: uint32(len(w))}, writeInSize), nil, w)
	if r := serve(t, q, wreq, 0, 64, 0); errnoOf(r) != 0 {
		t.Fatalf("WRITE within the restored max_write: %d", errnoOf(r))
	}
	// And it saves again, identically.
	dst.negotiated = want.Caps & negotiatedBits
	if b2 := saveServer(t, d); !bytes.Equal(b, b2) {
		t.Fatalf("second save differs")
	}
}

func TestStateNoSession(t *testing.T) {
	src := newMigFS()
	s := NewServer(src, ServerOptions{}, debugLogger())
	b := saveServer(t, s)
	if len(b) != 13+sessionRecordSize || !bytes.Equal(b[13:], append([]byte{1, 0, 0, 0}, make([]byte, 28)...)) {
		t.Fatalf("state without a session: % x", b)
	}
	// Replaces the destination's session.
	dst := newMigFS()
	d, q := newSession(t, dst.fakeFS)
	d.fs = dst
	if err := d.LoadState(bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	if _, ok := d.Session(); ok {
		t.Fatal("session after loading none")
	}
	if e := getattrErrno(t, q); e != -int32(syscall.EIO) {
		t.Fatalf("GETATTR: %d", e)
	}
	// After DESTROY, likewise.
	s2, m2 := migSession(t)
	q2 := s2.Queue(1)
	serve(t, q2, mkreq(OpDestroy, 9, nil, nil, nil), 0, 16, 0)
	m2.mounted, m2.negotiated = false, 0
	if b2 := saveServer(t, s2); !bytes.Equal(b, b2) {
		t.Fatal("state after DESTROY differs from none")
	}
}

// linux612Rust is the session the Rust virtiofsd 1.13 negotiates with Linux
// 6.12 with its default options (readdirplus on, announce_submounts on),
// written out bit by bit from its server.rs and fs/fuse/inode.c.
const linux612Rust = gofuse.CAP_ASYNC_READ | gofuse.CAP_ATOMIC_O_TRUNC | gofuse.CAP_BIG_WRITES |
	gofuse.CAP_IOCTL_DIR | gofuse.CAP_AUTO_INVAL_DATA | gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO |
	gofuse.CAP_ASYNC_DIO | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_MAX_PAGES | gofuse.CAP_SUBMOUNTS |
	gofuse.CAP_INIT_EXT | gofuse.CAP_CREATE_SUPP_GROUP | gofuse.CAP_ALLOW_IDMAP

// A stream without our session record comes from the Rust virtiofsd: the
// session is rebuilt as it negotiates with Linux 6.12, from what its state
// records and this daemon's own options; what this daemon cannot serve is
// refused.
func TestStateRustSession(t *testing.T) {
	ours := uint64(gofuse.CAP_ASYNC_READ) | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_EXPORT_SUPPORT | gofuse.CAP_ATOMIC_O_TRUNC |
		gofuse.CAP_BIG_WRITES | gofuse.CAP_AUTO_INVAL_DATA | gofuse.CAP_ASYNC_DIO | gofuse.CAP_READDIRPLUS |
		gofuse.CAP_READDIRPLUS_AUTO | gofuse.CAP_CREATE_SUPP_GROUP | gofuse.CAP_SUBMOUNTS
	const (
		supp = gofuse.CAP_CREATE_SUPP_GROUP
		subm = gofuse.CAP_SUBMOUNTS
		acl  = gofuse.CAP_POSIX_ACL | gofuse.CAP_DONT_MASK | gofuse.CAP_SETXATTR_EXT
		wb   = gofuse.CAP_WRITEBACK_CACHE
	)
	tests := []struct {
		name       string
		fsCaps     uint64
		negotiated uint64
		mounted    bool
		want       uint64 // 0: no session
		err        string
	}{
		{name: "defaults", fsCaps: ours, negotiated: supp | subm, mounted: true, want: linux612Rust},
		{name: "not announcing submounts", fsCaps: ours, negotiated: supp, mounted: true, want: linux612Rust &^ subm},
		{name: "a guest without CREATE_SUPP_GROUP", fsCaps: ours, negotiated: subm, mounted: true, want: linux612Rust &^ supp},
		{name: "writeback and ACLs", fsCaps: ours | wb | acl, negotiated: supp | subm | wb | acl, mounted: true,
			want: linux612Rust | wb | acl},
		{name: "killpriv_v2 assumed from here", fsCaps: ours | gofuse.CAP_HANDLE_KILLPRIV_V2, negotiated: supp | subm, mounted: true,
			want: linux612Rust | gofuse.CAP_HANDLE_KILLPRIV_V2},
		{name: "no readdirplus here", fsCaps: ours &^ (gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO), negotiated: supp | subm,
			mounted: true, want: linux612Rust &^ (gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO)},
		// The Rust stream does not record --security-label: taken from
		// the destination's options, as readdirplus.
		{name: "security labels here", fsCaps: ours | gofuse.CAP_SECURITY_CTX, negotiated: supp | subm, mounted: true,
			want: linux612Rust | gofuse.CAP_SECURITY_CTX},
		{name: "not mounted", fsCaps: ours, mounted: false},
		{name: "writeback off here", fsCaps: ours, negotiated: supp | subm | wb, mounted: true, err: "are off here"},
		{name: "no ATOMIC_O_TRUNC here", fsCaps: ours &^ gofuse.CAP_ATOMIC_O_TRUNC, negotiated: supp | subm, mounted: true,
			err: "capabilities 0x8 that are off here"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newMigFS()
			m.caps = tc.fsCaps
			d, q := newSession(t, m.fakeFS)
			d.fs = m
			before, _ := d.Session()
			err := d.LoadState(bytes.NewReader(fakeStream(tc.mounted, tc.negotiated, nil)))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("LoadState: %v, want %q", err, tc.err)
				}
				if after, ok := d.Session(); !ok || after != before || m.loads != 0 {
					t.Fatalf("session %+v → %+v", before, after)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, ok := d.Session()
			if tc.want == 0 {
				if ok {
					t.Fatalf("session %+v", got)
				}
				return
			}
			want := SessionInfo{Minor: 38, Caps: tc.want, MaxWrite: 1 << 20, MaxPages: 256, MaxReadahead: 128 << 10}
			if !ok || got != want || m.loadCaps != tc.want {
				t.Fatalf("session %+v (%v), caps to the file system %#x\nwant %+v", got, ok, m.loadCaps, want)
			}
			// A creation request with its supplementary group (the
			// Rust daemon negotiated CREATE_SUPP_GROUP) is served.
			req := withExt(mkreq(OpMkdir, 3, argBytes(gofuse.MkdirIn{Mode: 0o755}, 8), []string{"d"}, nil), groupsExt(1, 100))
			if r := serve(t, q, req, 0, 16+entryOutSize, 0); errnoOf(r) != 0 {
				t.Fatalf("MKDIR with a group: %d", errnoOf(r))
			}
			// A security context is served in a session with
			// SECURITY_CTX, refused in one without.
			req = withExt(mkreq(OpMkdir, 5, argBytes(gofuse.MkdirIn{Mode: 0o755}, 8), []string{"d"}, nil),
				secCtxExt(1, secCtxBody("security.selinux", "u:r:t:s0")))
			wantErr := int32(0)
			if tc.want&gofuse.CAP_SECURITY_CTX == 0 {
				wantErr = -int32(syscall.EINVAL)
			}
			if r := serve(t, q, req, 0, 16+entryOutSize, 0); errnoOf(r) != wantErr {
				t.Fatalf("MKDIR with a security context: %d, want %d", errnoOf(r), wantErr)
			}
		})
	}
}

// TestStateSecurityCtx: a session with SECURITY_CTX migrates to a
// destination with --security-label, which then serves the guest's
// contexts; one without refuses the state (its guest would send
// contexts it cannot set).
func TestStateSecurityCtx(t *testing.T) {
	src := newMigFS()
	src.caps |= gofuse.CAP_SECURITY_CTX
	s, _ := newSession(t, src.fakeFS)
	s.fs = src
	src.mounted = true
	ss, _ := s.Session()
	if ss.Caps&gofuse.CAP_SECURITY_CTX == 0 {
		t.Fatalf("source session %#x", ss.Caps)
	}
	src.negotiated = ss.Caps & negotiatedBits
	b := saveServer(t, s)

	off := newMigFS()
	if err := NewServer(off, ServerOptions{}, debugLogger()).LoadState(bytes.NewReader(b)); err == nil ||
		!strings.Contains(err.Error(), "0x100000000") {
		t.Fatalf("destination without security labels: %v", err)
	}
	on := newMigFS()
	on.caps |= gofuse.CAP_SECURITY_CTX
	d := NewServer(on, ServerOptions{}, debugLogger())
	if err := d.LoadState(bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	req := withExt(mkreq(OpMkdir, 5, argBytes(gofuse.MkdirIn{Mode: 0o755}, 8), []string{"d"}, nil),
		secCtxExt(1, secCtxBody("security.selinux", "u:r:t:s0")))
	if r := serve(t, d.Queue(1), req, 0, 16+entryOutSize, 0); errnoOf(r) != 0 {
		t.Fatalf("MKDIR with a context after the migration: %d", errnoOf(r))
	}
	if c := on.lastCalls(); len(c) == 0 || !slices.Contains(c[len(c)-1].Names, "security.selinux=u:r:t:s0") {
		t.Fatalf("calls %+v", c)
	}
}

func TestStateNotMigratable(t *testing.T) {
	s := NewServer(newFakeFS(), ServerOptions{}, debugLogger())
	s.LogAll(true)
	if err := s.SaveState(io.Discard); !errors.Is(err, ErrNotMigratable) {
		t.Fatalf("SaveState: %v", err)
	}
	if err := s.LoadState(bytes.NewReader(nil)); !errors.Is(err, ErrNotMigratable) {
		t.Fatalf("LoadState: %v", err)
	}
}

func TestStateLogAll(t *testing.T) {
	m := newMigFS()
	s := NewServer(m, ServerOptions{}, debugLogger())
	s.LogAll(true)
	s.LogAll(false)
	s.LogAll(true)
	if m.prepares != 2 || m.cancels != 1 {
		t.Fatalf("prepares %d cancels %d", m.prepares, m.cancels)
	}
}

func TestStateBadStreams(t *testing.T) {
	s, src := migSession(t)
	good := saveServer(t, s)
	caps := binary.LittleEndian.Uint64(good[13+12:])

	edit := func(off int, v uint64, size int) []byte {
		b := slices.Clone(good)
		switch size {
		case 4:
			binary.LittleEndian.PutUint32(b[13+off:], uint32(v))
		case 8:
			binary.LittleEndian.PutUint64(b[13+off:], v)
		}
		return b
	}
	none := fakeStream(false, 0, encodeSession(nil))
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "bad fake state"},
		{"record short", good[:13+sessionRecordSize-1], "record of 31 bytes"},
		{"record long", append(slices.Clone(good), 0), "record of 33 bytes"},
		{"version", edit(0, 2, 4), "version 2 is not supported"},
		{"flags", edit(4, 3, 4), "unknown flags"},
		{"minor low", edit(8, 26, 4), "protocol 7.26"},
		{"minor high", edit(8, KernelMinor+1, 4), "is not served here"},
		{"unknown caps", edit(12, caps|gofuse.CAP_SPLICE_READ, 8), "unknown to this daemon"},
		{"caps off here", edit(12, caps|gofuse.CAP_FLOCK_LOCKS, 8), "are off here"},
		{"caps disagree", fakeStream(true, src.negotiated^gofuse.CAP_WRITEBACK_CACHE, good[13:]), "disagree with the file system"},
		{"max_write 0", edit(20, 0, 4), "max_write 0"},
		{"max_write huge", edit(20, 1<<30, 4), "max_write"},
		{"max_pages 0", edit(24, 0, 4), "max_pages"},
		{"max_pages huge", edit(24, 1<<16, 4), "max_pages"},
		{"session but not mounted", fakeStream(false, src.negotiated, good[13:]), "disagrees with the file system's state"},
		{"mounted without a session", fakeStream(true, 0, none[13:]), "disagrees with the file system's state"},
		{"no session, fields", func() []byte {
			b := slices.Clone(none)
			b[13+8] = 1
			return b
		}(), "session fields"},
	}
	for _, tc := range cases {
		dst := newMigFS()
		d, q := newSession(t, dst.fakeFS)
		d.fs = dst
		before, _ := d.Session()
		err := d.LoadState(bytes.NewReader(tc.b))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: %v, want %q", tc.name, err, tc.want)
		}
		// Nothing installed: the session is as it was.
		if after, ok := d.Session(); !ok || after != before || dst.loads != 0 {
			t.Fatalf("%s: session %+v → %+v", tc.name, before, after)
		}
		for _, c := range dst.lastCalls() {
			if c.Op == "Destroy" || c.Op == "Init" {
				t.Fatalf("%s: %s called", tc.name, c.Op)
			}
		}
		if e := getattrErrno(t, q); e != 0 {
			t.Fatalf("%s: GETATTR after a failed load: %d", tc.name, e)
		}
	}
	// A file system that refuses its state leaves the session as it was.
	dst := newMigFS()
	dst.loadErr = errors.New("refused")
	d := NewServer(dst, ServerOptions{}, debugLogger())
	if err := d.LoadState(bytes.NewReader(good)); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("LoadState: %v", err)
	}
	if _, ok := d.Session(); ok {
		t.Fatal("session installed after the file system refused")
	}
}

// FuzzLoadSessionRecord: whatever the session record (or none: a Rust
// state), LoadState never panics, and a failed load leaves the session as
// it was.
func FuzzLoadSessionRecord(f *testing.F) {
	s, m := migSession(f)
	good := saveServer(f, s)
	f.Add(good[13:], true, m.negotiated, false)
	f.Add(encodeSession(nil), false, uint64(0), false)
	f.Add([]byte(nil), true, uint64(gofuse.CAP_CREATE_SUPP_GROUP), true)
	f.Add(good[13:20], true, m.negotiated, false)
	f.Fuzz(func(t *testing.T, rec []byte, mounted bool, negotiated uint64, rust bool) {
		if rust {
			rec = nil
		} else if rec == nil {
			rec = []byte{}
		}
		dst := newMigFS()
		d := NewServer(dst, ServerOptions{}, quietLogger())
		b := fakeStream(mounted, negotiated, rec)
		if rec != nil && len(rec) == 0 {
			// An empty record must still read as ours.
			return
		}
		if err := d.LoadState(bytes.NewReader(b)); err != nil {
			if _, ok := d.Session(); ok || dst.loads != 0 {
				t.Fatal("installed after an error")
			}
		}
	})
}

// The save logs what a Rust virtiofsd 1.13 destination would not serve:
// locks, a max_write beyond its 1 MiB; nothing for a session it serves.
func TestStateWarnRust(t *testing.T) {
	for _, tc := range []struct {
		name string
		ss   *session
		want string // "" for no warning
	}{
		{"none", nil, ""},
		{"rust's own", &session{minor: 38, caps: linux612Rust | gofuse.CAP_EXPORT_SUPPORT, maxWrite: 1 << 20}, ""},
		{"locks", &session{minor: 38, caps: linux612Rust | gofuse.CAP_POSIX_LOCKS | gofuse.CAP_FLOCK_LOCKS, maxWrite: 1 << 20},
			"capabilities POSIX_LOCKS (locks fail there)|FLOCK_LOCKS (flock fails there)"},
		{"max_write", &session{minor: 38, caps: linux612Rust, maxWrite: 4 << 20}, "max_write 4194304"},
	} {
		var buf bytes.Buffer
		s := NewServer(newFakeFS(), ServerOptions{}, slog.New(slog.NewTextHandler(&buf, nil)))
		s.warnRust(tc.ss)
		if got := buf.String(); (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%s: logged %q, want %q", tc.name, got, tc.want)
		}
	}
}

// A session at 7.45 with ALLOW_IDMAP (a Linux 7.2 guest) migrates to this
// daemon keeping both; the destination serves COPY_FILE_RANGE_64 at once.
func TestStateRoundTrip745(t *testing.T) {
	m := newMigFS()
	s := NewServer(m, ServerOptions{}, debugLogger())
	flags2 := kernelInitFlags2 | uint32((gofuse.CAP_ALLOW_IDMAP|gofuse.CAP_HAS_RESEND|gofuse.CAP_NO_EXPORT_SUPPORT|
		gofuse.CAP_REQUEST_TIMEOUT)>>32)
	if r := serve(t, s.Queue(0), initReq(1, 7, 45, kernelInitFlags, flags2, 64), 0, 80, 0); errnoOf(r) != 0 {
		t.Fatalf("INIT: %d", errnoOf(r))
	}
	m.mounted = true
	want, _ := s.Session()
	m.negotiated = want.Caps & negotiatedBits
	if want.Minor != 45 || want.Caps&gofuse.CAP_ALLOW_IDMAP == 0 ||
		want.Caps&(gofuse.CAP_HAS_RESEND|gofuse.CAP_NO_EXPORT_SUPPORT|gofuse.CAP_REQUEST_TIMEOUT) != 0 {
		t.Fatalf("source session %+v", want)
	}
	b := saveServer(t, s)
	d := NewServer(newMigFS(), ServerOptions{}, debugLogger())
	if err := d.LoadState(bytes.NewReader(b)); err != nil {
		t.Fatalf("LoadState: %v", err)
	}
	if got, ok := d.Session(); !ok || got != want {
		t.Fatalf("restored %+v, want %+v", got, want)
	}
	in := argBytes(gofuse.CopyFileRangeIn{FhIn: 1, FhOut: 2, NodeIdOut: 3, Len: 8 << 30}, copyInSize)
	r := serve(t, d.Queue(0), mkreq(OpCopyFileRange64, 9, in, nil, nil), 0, 16+8, 0)
	if errnoOf(r) != 0 || len(r) != 24 || binary.LittleEndian.Uint64(r[16:]) != 4096 {
		t.Fatalf("COPY_FILE_RANGE_64 after the load: % x", r)
	}
}

// A session above 7.38 is no obstacle to a Rust destination: the save says
// at info level what the guest then falls back from, and warns of nothing.
func TestStateWarnRustMinor(t *testing.T) {
	var buf bytes.Buffer
	s := NewServer(newFakeFS(), ServerOptions{}, slog.New(slog.NewTextHandler(&buf, nil)))
	s.warnRust(&session{minor: 45, caps: linux612Rust, maxWrite: 1 << 20})
	got := buf.String()
	if strings.Contains(got, "WARN") || !strings.Contains(got, "COPY_FILE_RANGE_64") || !strings.Contains(got, "7.45") {
		t.Fatalf("logged %q", got)
	}
}
