package passthrough

import (
	"bytes"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// hostHandle is the file handle of host path p.
func hostHandle(t *testing.T, p string) unix.FileHandle {
	t.Helper()
	h, _, err := unix.NameToHandleAt(unix.AT_FDCWD, p, 0)
	if err != nil {
		t.Fatalf("name_to_handle_at %s: %v", p, err)
	}
	return h
}

// A file-handles migration stream whose handle names an object outside
// the shared directory, on its very file system (a sibling of the share),
// is refused: a file, a directory, a file below a directory outside. Files
// inside, in the share and in its subdirectories, and directories at any
// depth open. (Here without a sandbox; test/integration's
// TestMigrationForgedHandle runs the daemon in each.)
func TestMigrationForgedHandle(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("open_by_handle_at needs CAP_DAC_READ_SEARCH")
	}
	src := newTestFS(t, Options{Migration: MigrationOptions{Mode: MigrationFileHandles}})
	os.MkdirAll(src.path("d/e/f"), 0o755)
	os.WriteFile(src.path("d/e/f/in"), []byte("inside"), 0o644)
	os.WriteFile(src.path("top"), []byte("top"), 0o644)
	os.WriteFile(filepath.Join(src.base, "secret"), []byte("outside"), 0o600)
	os.MkdirAll(filepath.Join(src.base, "out/deeper"), 0o755)
	os.WriteFile(filepath.Join(src.base, "out/deeper/secret"), []byte("outside too"), 0o600)

	d := src.lookup(rootID, "d").NodeId
	e := src.lookup(d, "e").NodeId
	ff := src.lookup(e, "f").NodeId
	in := src.lookup(ff, "in").NodeId
	top := src.lookup(rootID, "top").NodeId
	fh := src.open(in, unix.O_RDONLY)
	src.PrepareMigration()
	b := save(t, src.FS)
	src.CancelMigration()

	// The honest stream loads, in fd and in handle mode.
	for _, o := range []Options{{}, {InodeFileHandles: FileHandlesPrefer}} {
		dst := newDest(t, src, o)
		if err := dst.LoadState(bytes.NewReader(b), restoreCaps(src.caps.Load())); err != nil {
			t.Fatalf("the honest stream: %v", err)
		}
		if got := dst.read(in, fh, 0, 64); string(got) != "inside" {
			t.Fatalf("d/e/f/in reads %q", got)
		}
	}

	forge := func(node uint64, p string, rust bool) []byte {
		s := decoded(t, b)
		s.Ours = !rust // the Rust daemon's format: the message alone
		r := record(s, node)
		if r == nil || r.Loc != migstate.LocFileHandle {
			t.Fatalf("record of %#x: %+v", node, r)
		}
		h := hostHandle(t, p)
		r.Handle.Type, r.Handle.Bytes = h.Type(), h.Bytes()
		return reencode(t, s)
	}
	for _, tc := range []struct {
		name string
		node uint64
		path string
		want string
	}{
		{"file", top, filepath.Join(src.base, "secret"), "found in no directory of the shared directory"},
		{"file below a directory outside", in, filepath.Join(src.base, "out/deeper/secret"), "found in no directory"},
		{"directory", ff, filepath.Join(src.base, "out/deeper"), "outside the shared directory"},
		{"the share's parent", d, src.base, "outside the shared directory"},
		{"the root of the file system", e, "/", "outside the shared directory"},
	} {
		for _, rust := range []bool{false, true} {
			name := tc.name
			if rust {
				name += ", Rust format"
			}
			t.Run(name, func(t *testing.T) {
				testForgedLoad(t, src, forge(tc.node, tc.path, rust), tc.node, tc.want)
			})
		}
	}
}

// testForgedLoad loads forged into destinations in fd and handle mode:
// refused with want (abort), or node left stale (guest-error).
func testForgedLoad(t *testing.T, src *testFS, forged []byte, node uint64, want string) {
	t.Helper()
	for _, o := range []Options{{}, {InodeFileHandles: FileHandlesPrefer}} {
		loadFails(t, newDest(t, src, o), forged, want)
		// guest-error: the node is stale, never the outside object.
		o.Migration.OnError = MigrationGuestError
		ge := newDest(t, src, o)
		if err := ge.LoadState(bytes.NewReader(forged), restoreCaps(src.caps.Load())); err != nil {
			t.Fatal(err)
		}
		var ao gofuse.AttrOut
		if errno := ge.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(node)}, &ao); errno != syscall.ESTALE {
			t.Fatalf("GETATTR of the forged node: %v (ino %d), want ESTALE", errno, ao.Ino)
		}
	}
}
