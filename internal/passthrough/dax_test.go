package passthrough

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// fakeWindow is a Window that maps the fds it gets into a region of the
// test's own memory, so that tests read what a guest would see. Like
// QEMU it refuses a mapping past the end of the fd's file, and overlapping
// or straddling ranges behave as the contract says.
type fakeWindow struct {
	t    *testing.T
	size uint64
	mem  []byte // the window, PROT_READ|PROT_WRITE anonymous where unmapped

	mu       sync.Mutex
	maps     map[uint64]fakeMap // by window offset
	mapCalls int
	unmapAll int
	failMap  error // Map's answer when set
	// failUnmap is Unmap's answer for a range starting at that offset.
	failUnmap map[uint64]error
}

type fakeMap struct {
	length   uint64
	writable bool
	memfd    bool // the fd was a memfd (a tail)
}

func newFakeWindow(t *testing.T, size uint64) *fakeWindow {
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	w := &fakeWindow{t: t, size: size, mem: mem, maps: map[uint64]fakeMap{}}
	t.Cleanup(func() { unix.Munmap(mem) })
	return w
}

func (w *fakeWindow) Size() uint64 { return w.size }

func (w *fakeWindow) mmapAt(off, length uint64, prot, flags, fd int, fdOff uint64) error {
	addr := uintptr(unsafe.Pointer(&w.mem[off]))
	r, _, e := unix.Syscall6(unix.SYS_MMAP, addr, uintptr(length), uintptr(prot), uintptr(flags|unix.MAP_FIXED), uintptr(fd), uintptr(fdOff))
	if e != 0 {
		return e
	}
	if r != addr {
		w.t.Fatalf("mmap moved")
	}
	return nil
}

func (w *fakeWindow) Map(fd int, fdOffset, winOffset, length uint64, writable bool) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.mapCalls++
	if w.failMap != nil {
		return w.failMap
	}
	if length == 0 || (fdOffset|winOffset|length)%4096 != 0 || winOffset > w.size || length > w.size-winOffset {
		return unix.EINVAL
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if uint64(st.Size) < fdOffset+length {
		// QEMU: "backing store size ... is too small".
		return unix.EIO
	}
	for o, m := range w.maps {
		if o < winOffset+length && winOffset < o+m.length {
			w.unmapLocked(o, m.length)
		}
	}
	// As QEMU 11.1.3 does: shared and writable whatever writable says, so
	// an O_RDONLY fd fails (EACCES).
	prot := unix.PROT_READ | unix.PROT_WRITE
	if err := w.mmapAt(winOffset, length, prot, unix.MAP_SHARED, fd, fdOffset); err != nil {
		return err
	}
	name, _ := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	w.maps[winOffset] = fakeMap{length: length, writable: writable, memfd: bytes.HasPrefix([]byte(name), []byte("/memfd:"))}
	return nil
}

func (w *fakeWindow) unmapLocked(off, length uint64) {
	if err := w.mmapAt(off, length, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, -1, 0); err != nil {
		w.t.Fatalf("unmap: %v", err)
	}
	delete(w.maps, off)
}

func (w *fakeWindow) Unmap(winOffset, length uint64) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.failUnmap[winOffset]; err != nil {
		return err
	}
	end := winOffset + length
	for o, m := range w.maps {
		if o < end && winOffset < o+m.length && (o < winOffset || o+m.length > end) {
			return unix.EINVAL
		}
	}
	for o, m := range w.maps {
		if o >= winOffset && o+m.length <= end {
			w.unmapLocked(o, m.length)
		}
	}
	return nil
}

func (w *fakeWindow) UnmapAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.unmapAll++
	for o, m := range w.maps {
		w.unmapLocked(o, m.length)
	}
}

func (w *fakeWindow) live() map[uint64]fakeMap {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := make(map[uint64]fakeMap, len(w.maps))
	for k, v := range w.maps {
		c[k] = v
	}
	return c
}

const (
	slot2M = 2 << 20
	win16M = 16 << 20
	noFH   = ^uint64(0)
	rdMap  = 2
	rwMap  = 3
)

// daxFS is a test file system with a fake window of 16 MiB and a session
// that negotiated HAS_INODE_DAX.
func daxFS(t *testing.T, opts Options) (*testFS, *fakeWindow) {
	w := newFakeWindow(t, win16M)
	opts.Window = w
	tf := newTestFS(t, opts)
	tf.Init(tf.Capabilities() | gofuse.CAP_HAS_INODE_DAX | gofuse.CAP_MAP_ALIGNMENT)
	return tf, w
}

// pattern is n bytes of a recognisable pattern, seeded.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7+i/4096) ^ seed
	}
	return b
}

// mkfile writes data to name in the share and returns its node, looked up.
func (tf *testFS) mkfile(name string, data []byte) uint64 {
	tf.t.Helper()
	if err := os.WriteFile(tf.path(name), data, 0o644); err != nil {
		tf.t.Fatal(err)
	}
	return tf.lookup(rootID, name).NodeId
}

// guestView is what the guest reads at [moffset, moffset+n) of the window.
func (w *fakeWindow) guestView(moffset, n uint64) []byte {
	return append([]byte(nil), w.mem[moffset:moffset+n]...)
}

// want is what a guest must see through a mapping of length bytes of data
// at foffset: the file's bytes, zeros past its end.
func want(data []byte, foffset, length uint64) []byte {
	b := make([]byte, length)
	if foffset < uint64(len(data)) {
		copy(b, data[foffset:])
	}
	return b
}

// TestDAXTailSizes: read mappings of files of every size: the file's whole
// pages mapped from the file, the rest from a tail; on a --readonly share
// all of it a private copy (the VMM maps any fd writable).
func TestDAXTailSizes(t *testing.T) {
	for _, ro := range []bool{false, true} {
		t.Run(fmt.Sprintf("readonly=%v", ro), func(t *testing.T) { testDAXTailSizes(t, ro) })
	}
}

func testDAXTailSizes(t *testing.T, readonly bool) {
	tf, w := daxFS(t, Options{ReadOnly: readonly})
	openFlags := uint32(unix.O_RDONLY)
	for _, size := range []int{0, 1, 4095, 4096, 4097, slot2M - 1, slot2M, slot2M + 1, 3*slot2M + 12345} {
		data := pattern(size, byte(size))
		node := tf.mkfile("f"+strconv.Itoa(size), data)
		fh := tf.open(node, openFlags)
		for k := uint64(0); k*slot2M < uint64(size)+slot2M; k++ {
			moff := (k % (win16M / slot2M)) * slot2M
			if errno := tf.SetupMapping(hdr(node), noFH, k*slot2M, slot2M, rdMap, moff); errno != 0 {
				t.Fatalf("size %d slot %d: %v", size, k, errno)
			}
			if got := w.guestView(moff, slot2M); !bytes.Equal(got, want(data, k*slot2M, slot2M)) {
				t.Fatalf("size %d slot %d: the guest sees other bytes", size, k)
			}
			// The file part is mapped from the file, the rest from a
			// memfd: at most two mappings, the file's first.
			live := w.live()
			whole := uint64(size) &^ 4095
			fileLen := uint64(0)
			if !readonly && k*slot2M < whole {
				fileLen = min(slot2M, whole-k*slot2M)
			}
			if fileLen > 0 && (live[moff].length != fileLen || live[moff].memfd) {
				t.Fatalf("size %d slot %d: file part %+v, want %d", size, k, live[moff], fileLen)
			}
			if fileLen < slot2M && (!live[moff+fileLen].memfd || live[moff+fileLen].length != slot2M-fileLen) {
				t.Fatalf("size %d slot %d: tail %+v", size, k, live[moff+fileLen])
			}
		}
		tf.release(node, fh)
	}
	if n, fds := tf.MapStats(); n == 0 || fds%2 != 0 {
		t.Fatalf("%d mappings, %d fds", n, fds)
	}
	// A new session forgets them all, and unmaps them.
	tf.Init(tf.Capabilities())
	if n, fds := tf.MapStats(); n != 0 || fds != 0 || w.unmapAll == 0 || len(w.live()) != 0 {
		t.Fatalf("after INIT: %d mappings, %d fds, %d UnmapAll, %d live", n, fds, w.unmapAll, len(w.live()))
	}
}

func TestDAXMapUnmapReplace(t *testing.T) {
	tf, w := daxFS(t, Options{})
	a, b := pattern(3*slot2M, 1), pattern(3*slot2M, 2)
	na, nb := tf.mkfile("a", a), tf.mkfile("b", b)
	fa, fb := tf.open(na, unix.O_RDONLY), tf.open(nb, unix.O_RDONLY)
	if errno := tf.SetupMapping(hdr(na), fa, slot2M, slot2M, rdMap, 0); errno != 0 {
		t.Fatal(errno)
	}
	if !bytes.Equal(w.guestView(0, slot2M), a[slot2M:2*slot2M]) {
		t.Fatal("a's slot 1")
	}
	// Replacing the slot2M with b's.
	if errno := tf.SetupMapping(hdr(nb), noFH, 2*slot2M, slot2M, rdMap, 0); errno != 0 {
		t.Fatal(errno)
	}
	if !bytes.Equal(w.guestView(0, slot2M), b[2*slot2M:]) {
		t.Fatal("b's slot 2")
	}
	if n, _ := tf.MapStats(); n != 1 {
		t.Fatalf("%d mappings after a replacement", n)
	}
	// Two page mappings in one slot, then one over both.
	if errno := tf.SetupMapping(hdr(na), noFH, 0, 4096, rdMap, slot2M); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.SetupMapping(hdr(na), noFH, 8192, 4096, rdMap, slot2M+8192); errno != 0 {
		t.Fatal(errno)
	}
	// A REMOVEMAPPING whose second range cuts a mapping: EINVAL, and
	// nothing removed, not even the first range's.
	if errno := tf.RemoveMapping([]MapRange{{slot2M + 8192, 8192 * 2}, {0, 4096}}); errno != syscall.EINVAL {
		t.Fatalf("remove cutting a 2 MiB mapping: %v", errno)
	}
	if n, _ := tf.MapStats(); n != 3 || len(w.live()) != 3 {
		t.Fatalf("%d mappings, %d live after a refused remove", n, len(w.live()))
	}
	if errno := tf.RemoveMapping([]MapRange{{slot2M + 8192, 8192 * 2}}); errno != 0 {
		t.Fatalf("remove around the second page: %v", errno)
	}
	if n, _ := tf.MapStats(); n != 2 {
		t.Fatalf("%d mappings", n)
	}
	// The window fails to unmap the first range: the second is removed
	// all the same (Linux counts both free), the first stays recorded,
	// and the window's error is the answer.
	w.failUnmap = map[uint64]error{0: unix.EIO}
	if errno := tf.RemoveMapping([]MapRange{{0, slot2M}, {slot2M, slot2M}}); errno != syscall.EIO {
		t.Fatalf("remove with a failing unmap: %v", errno)
	}
	w.failUnmap = nil
	if n, _ := tf.MapStats(); n != 1 || len(w.live()) != 1 {
		t.Fatalf("%d mappings, %d live after a failed unmap", n, len(w.live()))
	}
	// A range with nothing mapped.
	if errno := tf.RemoveMapping([]MapRange{{4 * slot2M, slot2M}}); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.RemoveMapping([]MapRange{{0, 2 * slot2M}}); errno != 0 {
		t.Fatal(errno)
	}
	if n, _ := tf.MapStats(); n != 0 || len(w.live()) != 0 {
		t.Fatalf("%d mappings, %v live", n, w.live())
	}
	if bytes.Count(w.guestView(0, slot2M), []byte{0}) != slot2M {
		t.Fatal("the window still shows a file")
	}
	// The win16M's refusal is the answer, and nothing is recorded.
	w.failMap = unix.ENOSPC
	if errno := tf.SetupMapping(hdr(na), noFH, 0, slot2M, rdMap, 0); errno != syscall.ENOSPC {
		t.Fatal(errno)
	}
	w.failMap = nil
	if n, fds := tf.MapStats(); n != 0 || fds != 0 {
		t.Fatalf("%d mappings, %d fds after a failed map", n, fds)
	}
	tf.release(na, fa)
	tf.release(nb, fb)
}

// TestDAXTailHostWrite: a read tail, and a private copy on a read-only
// share, follow what a host process writes to the file (inotify,
// daxwatch.go): the guest's view equals the host file shortly after each
// write, append and truncation; the watch goes with the last mapping.
func TestDAXTailHostWrite(t *testing.T) {
	for _, ro := range []bool{false, true} {
		t.Run(map[bool]string{false: "tail", true: "readonly copy"}[ro], func(t *testing.T) {
			tf, w := daxFS(t, Options{ReadOnly: ro})
			if tf.dax.watch == nil {
				t.Skip("no inotify here")
			}
			data := pattern(slot2M+100, 4)
			node := tf.mkfile("f", data)
			fh := tf.open(node, unix.O_RDONLY)
			if errno := tf.SetupMapping(hdr(node), noFH, slot2M, slot2M, rdMap, 0); errno != 0 {
				t.Fatal(errno)
			}
			if errno := tf.SetupMapping(hdr(node), noFH, 0, slot2M, rdMap, slot2M); errno != 0 {
				t.Fatal(errno)
			}
			hf, err := os.OpenFile(tf.path("f"), os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer hf.Close()
			// seen waits until the guest's view of both slots equals the
			// host file (a wait for an event, not a timing target).
			seen := func(what string) {
				t.Helper()
				deadline := time.Now().Add(10 * time.Second)
				for {
					host, err := os.ReadFile(tf.path("f"))
					if err != nil {
						t.Fatal(err)
					}
					a, b := w.guestView(0, slot2M), w.guestView(slot2M, slot2M)
					if bytes.Equal(a, want(host, slot2M, slot2M)) && bytes.Equal(b, want(host, 0, slot2M)) {
						return
					}
					if time.Now().After(deadline) {
						t.Fatalf("%s: the guest's view still differs from the host file", what)
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			seen("mapped")
			if _, err := hf.WriteAt([]byte("HOST"), slot2M+10); err != nil {
				t.Fatal(err)
			}
			seen("host write in the last partial page")
			if _, err := hf.WriteAt(pattern(9000, 7), slot2M+100); err != nil {
				t.Fatal(err)
			}
			seen("host append")
			if _, err := hf.WriteAt([]byte("FRONT"), 100); err != nil {
				t.Fatal(err)
			}
			seen("host write in a whole page")
			if err := hf.Truncate(slot2M + 5); err != nil {
				t.Fatal(err)
			}
			seen("host truncate")
			tf.dax.watch.mu.Lock()
			n := len(tf.dax.watch.byTL)
			tf.dax.watch.mu.Unlock()
			if n == 0 {
				t.Fatal("no tail watched")
			}
			if errno := tf.RemoveMapping([]MapRange{{0, 2 * slot2M}}); errno != 0 {
				t.Fatal(errno)
			}
			tf.dax.watch.mu.Lock()
			n, nwd := len(tf.dax.watch.byTL), len(tf.dax.watch.byWD)
			tf.dax.watch.mu.Unlock()
			if n != 0 || nwd != 0 {
				t.Fatalf("%d tails, %d watches left after REMOVEMAPPING", n, nwd)
			}
			tf.release(node, fh)
		})
	}
}

// TestDAXTailFresh: a read tail follows WRITE (extending), truncation,
// FALLOCATE and COPY_FILE_RANGE made through requests.
func TestDAXTailFresh(t *testing.T) {
	tf, w := daxFS(t, Options{})
	data := pattern(slot2M+100, 3)
	node := tf.mkfile("f", data)
	ro := tf.open(node, unix.O_RDONLY)
	rw := tf.open(node, unix.O_RDWR)
	if errno := tf.SetupMapping(hdr(node), noFH, slot2M, slot2M, rdMap, 0); errno != 0 {
		t.Fatal(errno)
	}
	check := func(what string) {
		t.Helper()
		host, err := os.ReadFile(tf.path("f"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(w.guestView(0, slot2M), want(host, slot2M, slot2M)) {
			t.Fatalf("%s: the guest's tail differs from the host file", what)
		}
	}
	check("mapped")
	// An extending write.
	tf.write(node, rw, slot2M+50, pattern(10000, 9), 0)
	check("extending write")
	// A write inside the partial page.
	tf.write(node, rw, slot2M+1, []byte("hello"), 0)
	check("write")
	// Truncation down, then up.
	for _, size := range []uint64{slot2M + 7, slot2M + 5000, slot2M / 2} {
		var out gofuse.AttrOut
		in := &gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(node), Valid: gofuse.FATTR_SIZE, Size: size}}
		if errno := tf.SetAttr(in, &out); errno != 0 {
			t.Fatal(errno)
		}
		check("truncate to " + strconv.Itoa(int(size)))
	}
	// Writing in the tail again, past the end (a hole before it).
	tf.write(node, rw, slot2M+4096*3, []byte("far"), 0)
	check("write past the end")
	// FALLOCATE punching a hole in the tail.
	in := &gofuse.FallocateIn{InHeader: *hdr(node), Fh: rw, Offset: slot2M + 4096*3, Length: 4096,
		Mode: unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE}
	if errno := tf.Fallocate(in); errno != 0 {
		t.Fatal(errno)
	}
	check("punch hole")
	// COPY_FILE_RANGE from another file into the tail.
	src := tf.mkfile("src", pattern(8192, 5))
	sfh := tf.open(src, unix.O_RDONLY)
	cin := &gofuse.CopyFileRangeIn{InHeader: *hdr(src), FhIn: sfh, NodeIdOut: node, FhOut: rw, OffOut: slot2M + 10, Len: 8192}
	if n, errno := tf.CopyFileRange(cin, math.MaxUint64); errno != 0 || n != 8192 {
		t.Fatal(n, errno)
	}
	check("copy_file_range")
	// An O_APPEND handle writes at the end, whatever its offset.
	ap := tf.open(node, unix.O_WRONLY|unix.O_APPEND)
	tf.write(node, ap, 0, []byte("appended"), 0)
	check("append")
	for _, fh := range []uint64{ro, rw, ap, sfh} {
		tf.release(node, fh)
	}
}

// TestDAXWritableTail: guest stores to a writable tail reach the file at
// FSYNC, FLUSH, RELEASE, REMOVEMAPPING, replacement and INIT, and only the
// bytes inside the file.
func TestDAXWritableTail(t *testing.T) {
	for _, point := range []string{"fsync", "flush", "release", "remove", "replace", "init", "truncate"} {
		t.Run(point, func(t *testing.T) {
			tf, w := daxFS(t, Options{})
			data := pattern(5000, 4)
			node := tf.mkfile("f", data)
			fh := tf.open(node, unix.O_RDWR)
			if errno := tf.SetupMapping(hdr(node), noFH, 0, slot2M, rwMap, slot2M); errno != 0 {
				t.Fatal(errno)
			}
			if live := w.live(); !live[slot2M].writable || live[slot2M].length != 4096 || !live[slot2M+4096].memfd || !live[slot2M+4096].writable {
				t.Fatalf("mappings %+v", live)
			}
			// The guest stores into the first page (file) and the
			// partial page (tail), and past the end of the file.
			copy(w.mem[slot2M+10:], "FILEPAGE")
			copy(w.mem[slot2M+4096+5:], "TAILPAGE")
			copy(w.mem[slot2M+6000:], "PASTEND")
			host, _ := os.ReadFile(tf.path("f"))
			if string(host[10:18]) != "FILEPAGE" {
				t.Fatal("a store to the file's page is not the file's")
			}
			if string(host[4096+5:4096+13]) == "TAILPAGE" {
				t.Fatal("the tail reached the file before a write-back point")
			}
			switch point {
			case "fsync":
				errno := tf.Fsync(&gofuse.FsyncIn{InHeader: *hdr(node), Fh: fh})
				if errno != 0 {
					t.Fatal(errno)
				}
			case "flush":
				if errno := tf.Flush(&gofuse.FlushIn{InHeader: *hdr(node), Fh: fh}); errno != 0 {
					t.Fatal(errno)
				}
			case "release":
				tf.release(node, fh)
			case "remove":
				if errno := tf.RemoveMapping([]MapRange{{slot2M, slot2M}}); errno != 0 {
					t.Fatal(errno)
				}
			case "replace":
				if errno := tf.SetupMapping(hdr(node), noFH, 0, 4096, rdMap, slot2M); errno != 0 {
					t.Fatal(errno)
				}
			case "init":
				tf.Init(tf.Capabilities())
			case "truncate":
				var out gofuse.AttrOut
				in := &gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(node), Valid: gofuse.FATTR_SIZE, Size: 4096 + 7}}
				if errno := tf.SetAttr(in, &out); errno != 0 {
					t.Fatal(errno)
				}
			}
			host, _ = os.ReadFile(tf.path("f"))
			wantLen := 5000
			if point == "truncate" {
				wantLen = 4096 + 7
			}
			if len(host) != wantLen {
				t.Fatalf("the file has %d bytes, want %d", len(host), wantLen)
			}
			exp := append([]byte(nil), data[:wantLen]...)
			copy(exp[10:], "FILEPAGE")
			copy(exp[4096+5:], "TA")
			if wantLen > 4096+13 {
				copy(exp[4096+5:], "TAILPAGE")
			}
			if !bytes.Equal(host, exp) {
				t.Fatalf("after %s the host file differs from the guest's stores", point)
			}
			if point == "truncate" {
				// The tail was refreshed: past the new end it reads zeros.
				if !bytes.Equal(w.guestView(slot2M+4096, 4096), want(exp[4096:], 0, 4096)) {
					t.Fatal("the tail after truncation")
				}
			}
			if point != "release" {
				tf.release(node, fh)
			}
		})
	}
}

// TestDAXPermissions: the errnos of a refused SETUPMAPPING.
func TestDAXPermissions(t *testing.T) {
	tf, w := daxFS(t, Options{})
	node := tf.mkfile("f", pattern(10000, 1))
	other := tf.mkfile("g", pattern(10000, 2))
	dir := tf.mkdir(rootID, "d", 0o755).NodeId
	check := func(what string, h *gofuse.InHeader, fh, flags uint64, wantErr syscall.Errno) {
		t.Helper()
		if errno := tf.SetupMapping(h, fh, 0, slot2M, flags, 0); errno != wantErr {
			t.Fatalf("%s: %v, want %v", what, errno, wantErr)
		}
	}
	check("no handle open", hdr(node), noFH, rdMap, syscall.EBADF)
	check("unknown node", hdr(12345), noFH, rdMap, syscall.EBADF)
	check("directory", hdr(dir), noFH, rdMap, syscall.EINVAL)
	ro := tf.open(node, unix.O_RDONLY)
	ofh := tf.open(other, unix.O_RDWR)
	check("read, fh -1", hdr(node), noFH, rdMap, 0)
	check("read, its fh", hdr(node), ro, rdMap, 0)
	check("fh of another node", hdr(node), ofh, rdMap, syscall.EBADF)
	check("unknown fh", hdr(node), 999999, rdMap, syscall.EBADF)
	check("write without a writable handle", hdr(node), noFH, rwMap, syscall.EACCES)
	check("bad flags", hdr(node), noFH, 4, syscall.EINVAL)
	if errno := tf.SetupMapping(hdr(node), noFH, 0, slot2M, rdMap, slot2M-4096); errno != syscall.EINVAL {
		t.Fatalf("crossing a slot: %v", errno)
	}
	if errno := tf.SetupMapping(hdr(node), noFH, 0, slot2M, rdMap, win16M); errno != syscall.EINVAL {
		t.Fatalf("past the window: %v", errno)
	}
	rw := tf.open(node, unix.O_WRONLY)
	check("write with a writable handle", hdr(node), noFH, rwMap, 0)
	tf.release(node, rw)
	check("write after the writable handle's release", hdr(node), noFH, rwMap, syscall.EACCES)
	tf.release(node, ro)
	check("read after the last release", hdr(node), noFH, rdMap, syscall.EBADF)
	tf.release(other, ofh)
	_ = w

	// --readonly: never writable.
	rof, _ := daxFS(t, Options{ReadOnly: true})
	n := rof.mkfile("f", pattern(100, 1))
	rfh := rof.open(n, unix.O_RDONLY)
	if errno := rof.SetupMapping(hdr(n), noFH, 0, slot2M, rwMap, 0); errno != syscall.EROFS {
		t.Fatalf("readonly write mapping: %v", errno)
	}
	if errno := rof.SetupMapping(hdr(n), noFH, 0, slot2M, rdMap, 0); errno != 0 {
		t.Fatalf("readonly read mapping: %v", errno)
	}
	rof.release(n, rfh)

	// No window: ENOSYS.
	nw := newTestFS(t, Options{})
	n = nw.mkfile("f", nil)
	if errno := nw.SetupMapping(hdr(n), noFH, 0, slot2M, rdMap, 0); errno != syscall.ENOSYS {
		t.Fatal(errno)
	}
	if errno := nw.RemoveMapping([]MapRange{{0, slot2M}}); errno != syscall.ENOSYS || nw.WindowSize() != 0 {
		t.Fatal(errno)
	}
}

// TestDAXAttrFlag: FUSE_ATTR_DAX on regular files only, with HAS_INODE_DAX
// negotiated; with "flag", only on files with FS_XFLAG_DAX (which tmpfs
// and most test directories cannot set: none then).
func TestDAXAttrFlag(t *testing.T) {
	tf, _ := daxFS(t, Options{})
	node := tf.mkfile("f", nil)
	dir := tf.mkdir(rootID, "d", 0o755)
	if tf.lookup(rootID, "f").Attr.Flags&gofuse.ATTR_DAX == 0 || tf.getattr(node).Attr.Flags&gofuse.ATTR_DAX == 0 {
		t.Fatal("a regular file without FUSE_ATTR_DAX")
	}
	if dir.Attr.Flags&gofuse.ATTR_DAX != 0 || tf.getattr(dir.NodeId).Attr.Flags&gofuse.ATTR_DAX != 0 {
		t.Fatal("a directory with FUSE_ATTR_DAX")
	}
	tf.Init(tf.Capabilities()) // without HAS_INODE_DAX
	if tf.lookup(rootID, "f").Attr.Flags&gofuse.ATTR_DAX != 0 {
		t.Fatal("FUSE_ATTR_DAX without HAS_INODE_DAX")
	}

	ff, _ := daxFS(t, Options{InodeDAX: InodeDAXFlag})
	n := ff.mkfile("f", nil)
	if err := os.WriteFile(ff.path("flagged"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// Set FS_XFLAG_DAX on "flagged" where the host file system lets us
	// (ext4 and xfs do, whether or not their device can do DAX).
	setFlag := func(name string) bool {
		fd, err := unix.Open(ff.path(name), unix.O_RDONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		var fsx fsxattr
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsGetXattr, uintptr(unsafe.Pointer(&fsx))); e != 0 {
			return false
		}
		fsx.xflags |= fsXflagDAX
		const fsIocFsSetXattr = 1<<30 | uintptr(unsafe.Sizeof(fsxattr{}))<<16 | 'X'<<8 | 32
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsSetXattr, uintptr(unsafe.Pointer(&fsx)))
		return e == 0
	}
	canFlag := setFlag("flagged") // before the lookup: the daemon reads it once per inode
	flagged := ff.lookup(rootID, "flagged").NodeId
	if ff.getattr(n).Attr.Flags&gofuse.ATTR_DAX != 0 {
		t.Fatal("flag mode: FUSE_ATTR_DAX on a file without FS_XFLAG_DAX")
	}
	if got := ff.getattr(flagged).Attr.Flags&gofuse.ATTR_DAX != 0; got != canFlag {
		t.Fatalf("flag mode: FUSE_ATTR_DAX %v on a file whose FS_XFLAG_DAX was set: %v", got, canFlag)
	}
	if !canFlag {
		t.Log("the host file system does not take FS_XFLAG_DAX: only its absence was checked")
	}
	if _, err := New(ff.dir, Options{InodeDAX: "some"}, testLog); err == nil {
		t.Fatal("--inode-dax some accepted")
	}
}

// TestDAXSetWindowTypedNil: a nil pointer of a Window type is no window.
func TestDAXSetWindowTypedNil(t *testing.T) {
	tf := newTestFS(t, Options{})
	var w *fakeWindow
	tf.SetWindow(w)
	if tf.WindowSize() != 0 || tf.dax.on.Load() {
		t.Fatal("a nil *fakeWindow is a window")
	}
	tf.SetWindow(newFakeWindow(t, win16M))
	if tf.WindowSize() != win16M {
		t.Fatal(tf.WindowSize())
	}
}

// TestDAXConcurrent: WRITEs, truncations, FSYNCs and (re)mappings of one
// file race (run with -race); afterwards a read tail shows the file.
func TestDAXConcurrent(t *testing.T) {
	tf, w := daxFS(t, Options{})
	node := tf.mkfile("f", pattern(5000, 1))
	rw := tf.open(node, unix.O_RDWR)
	other := tf.mkfile("g", pattern(7000, 2))
	orw := tf.open(other, unix.O_RDWR)
	if errno := tf.SetupMapping(hdr(other), noFH, 0, slot2M, rwMap, 5*slot2M); errno != 0 {
		t.Fatal(errno)
	}
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range 50 {
				switch g {
				case 0:
					in := &gofuse.WriteIn{InHeader: *hdr(node), Fh: rw, Offset: uint64(4000 + k*100), Size: 300}
					tf.Write(in, vecOver(pattern(300, byte(k))))
				case 1:
					var out gofuse.AttrOut
					in := &gofuse.SetAttrIn{SetAttrInCommon: gofuse.SetAttrInCommon{InHeader: *hdr(node), Valid: gofuse.FATTR_SIZE, Size: uint64(3000 + k*150)}}
					tf.SetAttr(in, &out)
				case 2:
					flags := uint64(rdMap)
					if k%2 == 0 {
						flags = rwMap
					}
					tf.SetupMapping(hdr(node), noFH, 0, slot2M, flags, uint64(k%3)*slot2M)
				case 3:
					tf.Fsync(&gofuse.FsyncIn{InHeader: *hdr(node), Fh: rw})
					tf.RemoveMapping([]MapRange{{uint64(k%3) * slot2M, slot2M}})
				case 4, 5: // copies both ways between two mapped files
					in := &gofuse.CopyFileRangeIn{InHeader: *hdr(node), FhIn: rw, OffIn: 100, NodeIdOut: other, FhOut: orw, OffOut: 4000, Len: 2000}
					if g == 5 {
						in = &gofuse.CopyFileRangeIn{InHeader: *hdr(other), FhIn: orw, OffIn: 100, NodeIdOut: node, FhOut: rw, OffOut: 4100, Len: 2000}
					}
					tf.CopyFileRange(in, math.MaxUint64)
				}
			}
		}()
	}
	wg.Wait()
	tf.Init(tf.Capabilities() | gofuse.CAP_HAS_INODE_DAX) // writes the writable tails back, unmaps
	rw = tf.open(tf.lookup(rootID, "f").NodeId, unix.O_RDWR)
	node = tf.lookup(rootID, "f").NodeId
	if errno := tf.SetupMapping(hdr(node), noFH, 0, slot2M, rdMap, 0); errno != 0 {
		t.Fatal(errno)
	}
	tf.write(node, rw, 4090, []byte("0123456789"), 0)
	host, err := os.ReadFile(tf.path("f"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(w.guestView(0, slot2M), want(host, 0, slot2M)) {
		t.Fatal("the guest's view differs from the file")
	}
	if n, fds := tf.MapStats(); n != 1 || fds != 2 {
		t.Fatalf("%d mappings, %d fds", n, fds)
	}
}

// TestDAXCopyWhenNotWritable: a file the daemon cannot reopen for writing
// (here a running executable: ETXTBSY) is mapped to read as a private
// copy, never from an O_RDONLY fd the VMM would refuse; a WRITE mapping of
// it fails as OPEN for writing would.
func TestDAXCopyWhenNotWritable(t *testing.T) {
	tf, w := daxFS(t, Options{})
	exe, err := os.ReadFile("/bin/sleep")
	if err != nil {
		t.Skip(err)
	}
	node := tf.mkfile("busy", exe)
	if err := os.Chmod(tf.path("busy"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(tf.path("busy"), "30")
	if err := cmd.Start(); err != nil {
		t.Skip(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	fh := tf.open(node, unix.O_RDONLY)
	defer tf.release(node, fh)
	if errno := tf.SetupMapping(hdr(node), noFH, 0, slot2M, rdMap, 0); errno != 0 {
		t.Fatalf("read mapping of a running executable: %v", errno)
	}
	if got := w.guestView(0, slot2M); !bytes.Equal(got, want(exe, 0, slot2M)) {
		t.Fatal("the guest sees other bytes")
	}
	for off, m := range w.live() {
		if !m.memfd {
			t.Fatalf("mapping at %#x is the file itself, want a private copy", off)
		}
	}
}
