package fuse

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"slices"
	"strings"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// migFS is a fake file system that migrates: its state is fsState.
type migFS struct {
	*fakeFS
	loadErr   error
	loadCaps  uint64
	loads     int
	prepares  int
	cancels   int
	installed string
}

const fsState = "fake file system state"

func (m *migFS) PrepareMigration() { m.prepares++ }
func (m *migFS) CancelMigration()  { m.cancels++ }
func (m *migFS) SaveState(w io.Writer) error {
	_, err := io.WriteString(w, fsState)
	return err
}
func (m *migFS) LoadState(r io.Reader, caps uint64) error {
	b, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	if string(b) != fsState {
		return errors.New("bad fake state")
	}
	if m.loadErr != nil {
		return m.loadErr
	}
	m.loads++
	m.loadCaps = caps
	m.installed = string(b)
	return nil
}

func newMigFS() *migFS { return &migFS{fakeFS: newFakeFS()} }

func saveServer(t *testing.T, s *Server) []byte {
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
	src := newMigFS()
	s, _ := newSession(t, src.fakeFS)
	s.fs = src // the session was negotiated with the same capabilities
	want, ok := s.Session()
	if !ok || want.Minor != 38 || want.MaxWrite != DefaultMaxWrite || want.MaxPages != DefaultMaxPages {
		t.Fatalf("source session %+v %v", want, ok)
	}
	b := saveServer(t, s)

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
	if dst.loads != 1 || dst.loadCaps != want.Caps || dst.installed != fsState {
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
	if b2 := saveServer(t, d); !bytes.Equal(b, b2) {
		t.Fatalf("second save differs")
	}
}

func TestStateNoSession(t *testing.T) {
	src := newMigFS()
	s := NewServer(src, ServerOptions{}, debugLogger())
	b := saveServer(t, s)
	if len(b) != stateHeaderSize {
		t.Fatalf("state without a session: %d bytes", len(b))
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
	if c := dst.lastCalls(); len(c) == 0 || c[len(c)-1].Op != "Destroy" {
		t.Fatalf("calls %+v", c)
	}
	// After DESTROY, likewise.
	s2, q2 := newSession(t, src.fakeFS)
	s2.fs = src
	serve(t, q2, mkreq(OpDestroy, 9, nil, nil, nil), 0, 16, 0)
	if b2 := saveServer(t, s2); !bytes.Equal(b, b2) {
		t.Fatal("state after DESTROY differs from none")
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

// withCRC recomputes a header's checksum.
func withCRC(h []byte) []byte {
	binary.LittleEndian.PutUint32(h[40:], crc32.Checksum(h[:40], castagnoli))
	return h
}

func TestStateBadStreams(t *testing.T) {
	src := newMigFS()
	s, _ := newSession(t, src.fakeFS)
	s.fs = src
	good := saveServer(t, s)
	none := saveServer(t, NewServer(src, ServerOptions{}, debugLogger()))

	edit := func(off int, v uint64, size int) []byte {
		b := slices.Clone(good)
		switch size {
		case 4:
			binary.LittleEndian.PutUint32(b[off:], uint32(v))
		case 8:
			binary.LittleEndian.PutUint64(b[off:], v)
		}
		return withCRC(b)
	}
	caps := binary.LittleEndian.Uint64(good[20:])
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "truncated"},
		{"magic", append([]byte("GVFSFUSX"), good[8:]...), "not a govirtiofsd migration state"},
		{"version", edit(8, 2, 4), "version 2 is not supported"},
		{"checksum", append(slices.Clone(good[:30]), append([]byte{good[30] ^ 1}, good[31:]...)...), "checksum"},
		{"flags", edit(12, 3, 4), "unknown flags"},
		{"minor low", edit(16, 26, 4), "protocol 7.26"},
		{"minor high", edit(16, KernelMinor+1, 4), "is not served here"},
		{"unknown caps", edit(20, caps|gofuse.CAP_SPLICE_READ, 8), "unknown to this daemon"},
		{"caps off here", edit(20, caps|gofuse.CAP_POSIX_ACL, 8), "are off here"},
		{"max_write 0", edit(28, 0, 4), "max_write 0"},
		{"max_write huge", edit(28, 1<<30, 4), "max_write"},
		{"max_pages 0", edit(32, 0, 4), "max_pages"},
		{"max_pages huge", edit(32, 1<<16, 4), "max_pages"},
		{"fs state bad", append(slices.Clone(good), 'x'), "bad fake state"},
		{"fs state missing", good[:stateHeaderSize], "bad fake state"},
		{"no session, trailing", append(slices.Clone(none), 0), "bytes after"},
		{"no session, fields", func() []byte {
			b := slices.Clone(none)
			b[16] = 1
			return withCRC(b)
		}(), "session fields"},
	}
	for n := range stateHeaderSize {
		cases = append(cases, struct {
			name string
			b    []byte
			want string
		}{"prefix", good[:n], "truncated"})
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

// FuzzLoadStateHeader: LoadState never panics, and a failed load leaves
// the session as it was.
func FuzzLoadStateHeader(f *testing.F) {
	src := newMigFS()
	s := NewServer(src, ServerOptions{}, quietLogger())
	var none bytes.Buffer
	s.SaveState(&none)
	f.Add(none.Bytes())
	q := s.Queue(0)
	serve(f, q, initReq(1, 7, 38, kernelInitFlags, kernelInitFlags2, 64), 0, 80, 0)
	var good bytes.Buffer
	s.SaveState(&good)
	f.Add(good.Bytes())
	f.Add([]byte(stateMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		dst := newMigFS()
		d := NewServer(dst, ServerOptions{}, quietLogger())
		if err := d.LoadState(bytes.NewReader(b)); err != nil {
			if _, ok := d.Session(); ok || dst.loads != 0 {
				t.Fatal("installed after an error")
			}
		}
	})
}
