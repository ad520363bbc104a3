package passthrough

import (
	"bytes"
	"os"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// copyIn is a COPY_FILE_RANGE of n bytes from src at offIn to dst at offOut.
func copyIn(src, dst gofuse.CreateOut, offIn, offOut, n uint64) *gofuse.CopyFileRangeIn {
	return &gofuse.CopyFileRangeIn{InHeader: *hdr(src.NodeId), FhIn: src.Fh, OffIn: offIn,
		NodeIdOut: dst.NodeId, FhOut: dst.Fh, OffOut: offOut, Len: n}
}

func writeAt(t *testing.T, p string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func readAt(t *testing.T, p string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// A sparse source of 6 GiB with two data extents copies in one call of
// the 64-bit opcode, and the destination stays sparse: the host's splice
// copy would have written 6 GiB of zeros.
func TestCopyFileRangeSparse(t *testing.T) {
	tf := newTestFS(t, Options{})
	src := tf.create(rootID, "src", unix.O_RDWR, 0o644)
	dst := tf.create(rootID, "dst", unix.O_RDWR, 0o644)
	const size = 6 << 30
	a, b := bytes.Repeat([]byte("a"), 8192), bytes.Repeat([]byte("b"), 4096)
	writeAt(t, tf.path("src"), 4096, a)
	writeAt(t, tf.path("src"), 5<<30, b)
	if err := os.Truncate(tf.path("src"), size); err != nil {
		t.Fatal(err)
	}
	// The destination has data where the source has a hole: it must read
	// as zeros after the copy.
	writeAt(t, tf.path("dst"), 1<<20, []byte("old data"))
	n, errno := tf.CopyFileRange(copyIn(src, dst, 0, 0, 1<<62), ^uint64(0))
	if errno != 0 || n != size {
		t.Fatalf("copy: %d %v, want %d", n, errno, size)
	}
	st := statHost(t, tf.path("dst"))
	if st.Size != size {
		t.Fatalf("destination size %d", st.Size)
	}
	if st.Blocks*512 > 1<<20 {
		t.Fatalf("destination holds %d bytes: not sparse", st.Blocks*512)
	}
	if !bytes.Equal(readAt(t, tf.path("dst"), 4096, len(a)), a) || !bytes.Equal(readAt(t, tf.path("dst"), 5<<30, len(b)), b) {
		t.Fatal("data differs")
	}
	if got := readAt(t, tf.path("dst"), 1<<20, 8); !bytes.Equal(got, make([]byte, 8)) {
		t.Fatalf("old data in a hole of the source: %q", got)
	}
	// COPY_FILE_RANGE's 32-bit count: at most MaxCopy32 (0xfffff000).
	n, errno = tf.CopyFileRange(copyIn(src, dst, 0, 0, size), 0xfffff000)
	if errno != 0 || n != 0xfffff000 {
		t.Fatalf("32-bit copy: %#x %v", n, errno)
	}
	// From an offset within the last data extent to the end of the
	// source, at an offset past the destination's end.
	n, errno = tf.CopyFileRange(copyIn(src, dst, 5<<30+4000, 7<<30, 1<<40), ^uint64(0))
	if errno != 0 || n != size-(5<<30+4000) {
		t.Fatalf("tail copy: %d %v", n, errno)
	}
	if st := statHost(t, tf.path("dst")); st.Size != 7<<30+int64(n) {
		t.Fatalf("size after the tail copy %d", st.Size)
	}
	if got := readAt(t, tf.path("dst"), 7<<30, 100); !bytes.Equal(got[:96], b[:96]) || !bytes.Equal(got[96:], make([]byte, 4)) {
		t.Fatalf("tail data %q", got)
	}
	// Past the source's end: nothing.
	if n, errno = tf.CopyFileRange(copyIn(src, dst, size, 0, 4096), ^uint64(0)); errno != 0 || n != 0 {
		t.Fatalf("copy at the end: %d %v", n, errno)
	}
}

// A plain copy, the checks the kernel makes before anything is punched,
// and one file's own ranges.
func TestCopyFileRangeChecks(t *testing.T) {
	tf := newTestFS(t, Options{})
	src := tf.create(rootID, "src", unix.O_RDWR, 0o644)
	dst := tf.create(rootID, "dst", unix.O_RDWR, 0o644)
	data := bytes.Repeat([]byte("0123456789abcdef"), 4096)
	writeAt(t, tf.path("src"), 0, data)
	writeAt(t, tf.path("dst"), 0, bytes.Repeat([]byte("x"), 100))
	if n, errno := tf.CopyFileRange(copyIn(src, dst, 16, 10, 1000), ^uint64(0)); errno != 0 || n != 1000 {
		t.Fatalf("copy %d %v", n, errno)
	}
	if got := readAt(t, tf.path("dst"), 0, 1010); string(got[:10]) != "xxxxxxxxxx" || !bytes.Equal(got[10:], data[16:1016]) {
		t.Fatalf("content %q", got[:40])
	}
	in := copyIn(src, dst, 0, 0, 10)
	in.Flags = 1
	if _, errno := tf.CopyFileRange(in, ^uint64(0)); errno != syscall.EINVAL {
		t.Fatalf("flags: %v, want EINVAL", errno)
	}
	// A read-only destination handle: EBADF, and nothing was punched
	// although the source's range starts with a hole.
	if err := os.Truncate(tf.path("src"), 1<<20); err != nil {
		t.Fatal(err)
	}
	ro := gofuse.CreateOut{EntryOut: dst.EntryOut}
	ro.Fh = tf.open(dst.NodeId, unix.O_RDONLY)
	if _, errno := tf.CopyFileRange(copyIn(src, ro, 512<<10, 0, 4096), ^uint64(0)); errno != syscall.EBADF {
		t.Fatalf("read-only destination: %v, want EBADF", errno)
	}
	if got := readAt(t, tf.path("dst"), 0, 10); string(got) != "xxxxxxxxxx" {
		t.Fatalf("destination changed: %q", got)
	}
	app := gofuse.CreateOut{EntryOut: dst.EntryOut}
	app.Fh = tf.open(dst.NodeId, unix.O_WRONLY|unix.O_APPEND)
	if _, errno := tf.CopyFileRange(copyIn(src, app, 512<<10, 0, 4096), ^uint64(0)); errno != syscall.EBADF {
		t.Fatalf("O_APPEND destination: %v, want EBADF", errno)
	}
	// Within one file: apart, copied; overlapping, EINVAL.
	if n, errno := tf.CopyFileRange(copyIn(src, src, 0, 4096, 100), ^uint64(0)); errno != 0 || n != 100 {
		t.Fatalf("same file: %d %v", n, errno)
	}
	if _, errno := tf.CopyFileRange(copyIn(src, src, 0, 50, 100), ^uint64(0)); errno != syscall.EINVAL {
		t.Fatalf("overlapping: %v, want EINVAL", errno)
	}
	// Offsets that would pass the largest file offset are clamped, not
	// wrapped.
	if n, errno := tf.CopyFileRange(copyIn(src, dst, 0, 1<<62, ^uint64(0)), ^uint64(0)); errno != 0 && errno != syscall.EFBIG || n > 1<<20 {
		t.Fatalf("huge length: %d %v", n, errno)
	}
}
