package integration

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// hostHandleBytes is the file handle of host path p, as name_to_handle_at
// gives it (its bytes; the type is the file system's).
func hostHandleBytes(t *testing.T, p string) []byte {
	t.Helper()
	h, _, err := unix.NameToHandleAt(unix.AT_FDCWD, p, 0)
	if err != nil {
		t.Fatalf("name_to_handle_at %s: %v", p, err)
	}
	return h.Bytes()
}

// forgeHandle replaces, in our state stream, the one occurrence of the file
// handle bytes of host path from by those of host path to (same file
// system: same type and length), and fixes the trailer's CRC-32C (of every
// byte before it: internal/passthrough/migstate's stream).
func forgeHandle(t *testing.T, state []byte, from, to string) []byte {
	t.Helper()
	old, repl := hostHandleBytes(t, from), hostHandleBytes(t, to)
	if len(old) != len(repl) || bytes.Count(state, old) != 1 {
		t.Fatalf("the handle of %s (%x) is in the stream %d times; %s's is %x", from, old, bytes.Count(state, old), to, repl)
	}
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	if binary.LittleEndian.Uint32(state[len(state)-4:]) != crc32.Checksum(state[:len(state)-4], castagnoli) {
		t.Fatal("the stream does not end with our trailer's checksum")
	}
	forged := bytes.Replace(state, old, repl, 1)
	binary.LittleEndian.PutUint32(forged[len(forged)-4:], crc32.Checksum(forged[:len(forged)-4], castagnoli))
	return forged
}

// TestMigrationForgedHandle: a file-handles migration stream whose handle
// is forged to name an object outside the shared directory on its very
// file system (a sibling of the share: a file, a directory) is refused by
// the destination, or with --migration-on-error guest-error leaves the
// node stale; never is the outside object served. The destination holds
// CAP_DAC_READ_SEARCH (the default --inode-file-handles=prefer on a file
// system that gives handles), so open_by_handle_at itself would open
// anything. In whichever sandbox the run uses (namespace and chroot:
// GOVIRTIOFSD_INTEGRATION_SANDBOX; none: the race build).
func TestMigrationForgedHandle(t *testing.T) {
	if shareKind == "overlay-budget" {
		t.Skip("--migration-mode file-handles needs a share whose file system gives handles; this overlayfs gives none")
	}
	src := startDaemon(t, "--migration-mode", "file-handles")
	outside := filepath.Dir(src.dir)
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("outside the share"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(outside, "outdir", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	src.writeHostFile("f", []byte("inside"))
	if err := os.MkdirAll(filepath.Join(src.dir, "d", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	sdev := src.connect(migOpts())
	c := newFS(t, sdev, 1)
	c.mount()
	f := c.lookup(vmm.RootID, "f").NodeID
	fh := c.open(f, syscall.O_RDONLY)
	d := c.lookup(vmm.RootID, "d").NodeID
	state := saveState(t, sdev)

	// The honest stream loads, in our format and in the Rust daemon's
	// (the same message without our trailer).
	rust := func(s []byte) []byte {
		k := bytes.LastIndex(s, []byte("GVFSTAIL"))
		if k < 0 {
			t.Fatal("no trailer in our state")
		}
		return s[:k]
	}
	for _, s := range [][]byte{state, rust(state)} {
		_, hdev := destination(t, src)
		if got := string(load(t, hdev, s).read(f, fh, 0, 64)); got != "inside" {
			t.Fatalf("READ of f after the honest stream: %q", got)
		}
	}

	for _, tc := range []struct {
		name     string
		node     uint64
		from, to string
		why      string
	}{
		{"file", f, filepath.Join(src.dir, "f"), filepath.Join(outside, "secret"), "found in no directory of the shared directory"},
		{"directory", d, filepath.Join(src.dir, "d"), filepath.Join(outside, "outdir"), "opens a directory outside the shared directory"},
	} {
		for _, format := range []string{"ours", "Rust"} {
			t.Run(tc.name+", "+format, func(t *testing.T) {
				forged := forgeHandle(t, state, tc.from, tc.to)
				if format == "Rust" {
					forged = rust(forged)
				}
				testForgedStream(t, src, forged, tc.node, f, fh, tc.why)
			})
		}
	}
}

// testForgedStream loads forged on a destination, which must refuse it
// (saying why), and on one with --migration-on-error guest-error, where
// node must answer ESTALE (f and fh: the file and its open handle).
func testForgedStream(t *testing.T, src *daemon, forged []byte, node, f, fh uint64, why string) {
	t.Helper()
	dst, ddev := destination(t, src)
	err := ddev.LoadState(forged)
	var re *vmm.ReplyError
	if !errors.As(err, &re) || re.Request != vmm.CheckDeviceState {
		t.Fatalf("the forged stream: %v, want CHECK_DEVICE_STATE to fail", err)
	}
	waitLog(t, dst, why)

	ge, gdev := destination(t, src, "--migration-on-error", "guest-error")
	g := load(t, gdev, forged)
	waitLog(t, ge, why)
	if _, err := g.Getattr(node); !errors.Is(err, syscall.ESTALE) {
		t.Errorf("GETATTR of the forged node: %v, want ESTALE", err)
	}
	if node == f {
		if b, err := g.Read(f, fh, 0, 64); !errors.Is(err, syscall.ESTALE) {
			t.Errorf("READ through the forged node's handle: %q, %v; want ESTALE", b, err)
		}
	} else if _, err := g.Lookup(node, "x"); !errors.Is(err, syscall.ESTALE) {
		t.Errorf("LOOKUP below the forged directory: %v, want ESTALE", err)
	}
}
