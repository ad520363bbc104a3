package passthrough

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// ioFixture is an open file on tmpfs (when available) with a bufvec built
// once over size bytes, split in 4 KiB pages like a FUSE request.
type ioFixture struct {
	fs   *FS
	node uint64
	fh   uint64
	vec  *bufvec.Vec
}

func newIOFixture(tb testing.TB, size int) *ioFixture {
	dir := shmTempDir(tb, "passthrough-bench")
	if err := os.WriteFile(filepath.Join(dir, "f"), make([]byte, size), 0o644); err != nil {
		tb.Fatal(err)
	}
	f, err := New(dir, Options{Cache: CacheNever}, testLog)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { f.Close() })
	f.Init(f.Capabilities())
	var e gofuse.EntryOut
	if errno := f.Lookup(hdr(rootID), []byte("f"), &e); errno != 0 {
		tb.Fatal(errno)
	}
	var oo gofuse.OpenOut
	if errno := f.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDWR}, &oo); errno != 0 {
		tb.Fatal(errno)
	}
	const page = 4096
	backing := make([]byte, size)
	v := bufvec.NewVec((size + page - 1) / page)
	for off := 0; off < size; off += page {
		n := min(page, size-off)
		if err := v.Append(bufvec.Segment{Buf: backing[off : off+n], Len: uint32(n)}); err != nil {
			tb.Fatal(err)
		}
	}
	return &ioFixture{fs: f, node: e.NodeId, fh: oo.Fh, vec: v}
}

func (x *ioFixture) read(tb testing.TB, in *gofuse.ReadIn) {
	x.vec.Rewind()
	if n, errno := x.fs.Read(in, x.vec); errno != 0 || n != int(in.Size) {
		tb.Fatal(n, errno)
	}
}

func (x *ioFixture) write(tb testing.TB, in *gofuse.WriteIn) {
	x.vec.Rewind()
	if n, errno := x.fs.Write(in, x.vec); errno != 0 || n != int(in.Size) {
		tb.Fatal(n, errno)
	}
}

var ioSizes = []int{4 << 10, 1 << 20}

// TestReadWriteAllocs proves the data path allocates nothing.
func TestReadWriteAllocs(t *testing.T) {
	for _, size := range ioSizes {
		x := newIOFixture(t, size)
		rin := &gofuse.ReadIn{InHeader: *hdr(x.node), Fh: x.fh, Size: uint32(size)}
		win := &gofuse.WriteIn{InHeader: *hdr(x.node), Fh: x.fh, Size: uint32(size)}
		if a := testing.AllocsPerRun(100, func() { x.read(t, rin) }); a != 0 {
			t.Errorf("Read %d: %v allocs", size, a)
		}
		if a := testing.AllocsPerRun(100, func() { x.write(t, win) }); a != 0 {
			t.Errorf("Write %d: %v allocs", size, a)
		}
		var ao gofuse.AttrOut
		gin := &gofuse.GetAttrIn{InHeader: *hdr(x.node)}
		if a := testing.AllocsPerRun(100, func() { x.fs.GetAttr(gin, &ao) }); a != 0 {
			t.Errorf("GetAttr: %v allocs", a)
		}
	}
}

func BenchmarkRead(b *testing.B) {
	benchIO(b, func(b *testing.B, x *ioFixture, size int) func() {
		in := &gofuse.ReadIn{InHeader: *hdr(x.node), Fh: x.fh, Size: uint32(size)}
		return func() { x.read(b, in) }
	})
}

func BenchmarkWrite(b *testing.B) {
	benchIO(b, func(b *testing.B, x *ioFixture, size int) func() {
		in := &gofuse.WriteIn{InHeader: *hdr(x.node), Fh: x.fh, Size: uint32(size)}
		return func() { x.write(b, in) }
	})
}

// benchIO measures, for each of ioSizes, the request op makes for a
// fixture of that size.
func benchIO(b *testing.B, op func(b *testing.B, x *ioFixture, size int) func()) {
	for _, size := range ioSizes {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			do := op(b, newIOFixture(b, size), size)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				do()
			}
		})
	}
}

func BenchmarkGetAttr(b *testing.B) {
	x := newIOFixture(b, 4096)
	in := &gofuse.GetAttrIn{InHeader: *hdr(x.node)}
	var out gofuse.AttrOut
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if errno := x.fs.GetAttr(in, &out); errno != 0 {
				b.Fatal(errno)
			}
		}
	})
}

func BenchmarkLookupForget(b *testing.B) {
	x := newIOFixture(b, 4096)
	var e gofuse.EntryOut
	name := []byte("f")
	b.ReportAllocs()
	for b.Loop() {
		if errno := x.fs.Lookup(hdr(rootID), name, &e); errno != 0 {
			b.Fatal(errno)
		}
		x.fs.Forget(e.NodeId, 1)
	}
}

// Many goroutines look up, read, stat and forget the same and different
// inodes; at the end the guest holds nothing and every fd is closed.
func TestConcurrentLookupsForgetsReads(t *testing.T) {
	tf := newTestFS(t, Options{})
	const files = 16
	for i := range files {
		os.WriteFile(tf.path(fmt.Sprint(i)), []byte(fmt.Sprintf("content-%d", i)), 0o644)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 64)
			v := bufvec.NewVec(1)
			for it := range 300 {
				i := (g + it) % files
				name := []byte(fmt.Sprint(i))
				var e gofuse.EntryOut
				if errno := tf.Lookup(hdr(rootID), name, &e); errno != 0 {
					errs <- fmt.Errorf("lookup: %v", errno)
					return
				}
				var oo gofuse.OpenOut
				if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDONLY}, &oo); errno != 0 {
					errs <- fmt.Errorf("open: %v", errno)
					return
				}
				v.Reset()
				v.Append(bufvec.Segment{Buf: buf, Len: uint32(len(buf))})
				n, errno := tf.Read(&gofuse.ReadIn{InHeader: *hdr(e.NodeId), Fh: oo.Fh, Size: 64}, v)
				if errno != 0 || string(buf[:n]) != fmt.Sprintf("content-%d", i) {
					errs <- fmt.Errorf("read %q %v", buf[:n], errno)
					return
				}
				var ao gofuse.AttrOut
				if errno := tf.GetAttr(&gofuse.GetAttrIn{InHeader: *hdr(e.NodeId)}, &ao); errno != 0 {
					errs <- fmt.Errorf("getattr: %v", errno)
					return
				}
				tf.Release(&gofuse.ReleaseIn{InHeader: *hdr(e.NodeId), Fh: oo.Fh})
				tf.Forget(e.NodeId, 1)
				// Hostile noise: ids that were never handed
				// out must not disturb anyone.
				tf.Forget(e.NodeId|1<<31, 1)
				tf.Forget(uint64(i+2), 1)
			}
		}()
	}
	// A READDIRPLUS loop runs alongside, taking and dropping lookups.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 30 {
			fh := tf.opendir(rootID)
			tf.ReadDir(&gofuse.ReadIn{InHeader: *hdr(rootID), Fh: fh}, true, func(name []byte, ino uint64, typ uint32, off uint64) (*gofuse.EntryOut, bool) {
				return &gofuse.EntryOut{}, true
			})
			tf.ReleaseDir(&gofuse.ReleaseIn{InHeader: *hdr(rootID), Fh: fh})
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// The readdirplus loop dropped its entries without forgetting them:
	// forget by walking the table.
	tf.nodes.drain(func(i *inode) {
		ks := &tf.keys[i.key.hash()%keyShards]
		ks.mu.Lock()
		ks.remove(i)
		ks.mu.Unlock()
		i.put()
	})
	if s := tf.Stats(); s.Inodes != 0 || s.Handles != 0 || s.InodeFDs != tf.baseFDs || s.HandleFDs != 0 {
		t.Fatalf("leak: %+v", s)
	}
}

// Subprocess tests: the test binary re-runs itself with PT_HELPER set.

func runHelper(t *testing.T, name string, attr *syscall.SysProcAttr, env ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.v")
	cmd.Env = append(os.Environ(), append(env, "PT_HELPER="+name)...)
	cmd.SysProcAttr = attr
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper %s: %v\n%s", name, err, out)
	}
	return string(out)
}

func TestHelperProcess(t *testing.T) {
	switch os.Getenv("PT_HELPER") {
	case "":
		t.Skip("helper only")
	case "emfile":
		helperEMFILE(t)
	case "setgid":
		helperSetgid(t)
	case "migrate-emfile":
		helperMigrateEMFILE(t)
	}
}

// writeFiles makes n files of one byte in the share, named 0 to n-1.
func (tf *testFS) writeFiles(n int) {
	for k := range n {
		os.WriteFile(tf.path(fmt.Sprint(k)), []byte("x"), 0o644)
	}
}

// limitFDs lowers RLIMIT_NOFILE so that about room more fds can be opened
// than are open now, and returns the limit it replaced.
func limitFDs(t *testing.T, room int) unix.Rlimit {
	t.Helper()
	var rl unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: uint64(openFDs(t) + room), Max: rl.Max}); err != nil {
		t.Fatal(err)
	}
	return rl
}

// Exhausting RLIMIT_NOFILE gives the guest EMFILE, never a crash, and
// everything works again once it forgets and releases.
func TestEMFILE(t *testing.T) {
	runHelper(t, "emfile", nil)
}

func helperEMFILE(t *testing.T) {
	tf := newTestFS(t, Options{})
	const files = 300
	tf.writeFiles(files)
	limitFDs(t, 100)
	var nodes, fhs []uint64
	var hit syscall.Errno
	for i := range files {
		var e gofuse.EntryOut
		if errno := tf.Lookup(hdr(rootID), []byte(fmt.Sprint(i)), &e); errno != 0 {
			hit = errno
			break
		}
		nodes = append(nodes, e.NodeId)
		var oo gofuse.OpenOut
		if errno := tf.Open(&gofuse.OpenIn{InHeader: *hdr(e.NodeId), Flags: unix.O_RDONLY}, &oo); errno != 0 {
			hit = errno
			break
		}
		fhs = append(fhs, oo.Fh)
	}
	if hit != syscall.EMFILE {
		t.Fatalf("got %v after %d lookups, want EMFILE", hit, len(nodes))
	}
	// Other operations fail cleanly too.
	var co gofuse.CreateOut
	for range 3 {
		if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: unix.O_RDWR, Mode: 0o644}, noGroup, nil, []byte("new"), &co); errno == 0 {
			tf.release(co.NodeId, co.Fh)
		}
	}
	fh := uint64(0)
	var oo gofuse.OpenOut
	tf.OpenDir(&gofuse.OpenIn{InHeader: *hdr(rootID)}, &oo)
	fh = oo.Fh
	_ = fh
	t.Logf("EMFILE after %d lookups and %d opens", len(nodes), len(fhs))
	for i, n := range nodes {
		if i < len(fhs) {
			tf.Release(&gofuse.ReleaseIn{InHeader: *hdr(n), Fh: fhs[i]})
		}
		tf.Forget(n, 1)
	}
	// Recovered.
	for i := range 20 {
		e := tf.lookup(rootID, fmt.Sprint(i))
		fh := tf.open(e.NodeId, unix.O_RDONLY)
		tf.release(e.NodeId, fh)
	}
}

// CVE-2022-0358: a daemon started with supplementary groups creates a file
// with the setgid bit in a setgid directory of one of its groups on behalf
// of a caller outside that group: after DropSupplementaryGroups the bit
// must be cleared, as the kernel does for that caller.
func TestSetgidDirWithSupplementaryGroups(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	attr := &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 0, Gid: 0, Groups: []uint32{4242}}}
	out := runHelper(t, "setgid", attr)
	t.Log(out)
}

func helperSetgid(t *testing.T) {
	gs, _ := syscall.Getgroups()
	found := false
	for _, g := range gs {
		found = found || g == 4242
	}
	if !found {
		t.Fatalf("helper lacks group 4242: %v", gs)
	}
	try := func(name string) uint32 {
		tf := newTestFS(t, Options{})
		os.Chmod(tf.dir, 0o777)
		d := filepath.Join(tf.dir, "sgid")
		os.Mkdir(d, 0o777)
		os.Chown(d, 0, 4242)
		unix.Chmod(d, 0o2777)
		e := tf.lookup(rootID, "sgid")
		var co gofuse.CreateOut
		if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdrAs(e.NodeId, 1000, 1000), Flags: unix.O_RDWR, Mode: 0o2775}, noGroup, nil, []byte(name), &co); errno != 0 {
			t.Fatal(errno)
		}
		tf.release(co.NodeId, co.Fh)
		var me gofuse.EntryOut
		if errno := tf.Mknod(&gofuse.MknodIn{InHeader: *hdrAs(e.NodeId, 1000, 1000), Mode: unix.S_IFREG | 0o2775}, noGroup, nil, []byte(name+"-mknod"), &me); errno != 0 {
			t.Fatal(errno)
		}
		st := statHost(t, filepath.Join(d, name))
		if st.Gid != 4242 {
			t.Fatalf("gid %d: setgid dir not inherited", st.Gid)
		}
		if m := statHost(t, filepath.Join(d, name+"-mknod")).Mode; m&unix.S_ISGID != st.Mode&unix.S_ISGID {
			t.Fatalf("mknod and create disagree: %o vs %o", m, st.Mode)
		}
		return st.Mode & 0o7777
	}
	before := try("before")
	if err := DropSupplementaryGroups(); err != nil {
		t.Fatal(err)
	}
	if gs, _ := syscall.Getgroups(); len(gs) != 0 {
		t.Fatalf("groups left: %v", gs)
	}
	after := try("after")
	t.Logf("mode with the daemon in group 4242: %o; after dropping groups: %o", before, after)
	if after&unix.S_ISGID != 0 {
		t.Fatalf("setgid bit kept (%o) for a caller outside the group", after)
	}
	if before&unix.S_ISGID == 0 {
		t.Logf("note: the kernel cleared the bit even with the group held")
	}
}

func TestRaiseNofileLimit(t *testing.T) {
	var rl unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	got, err := RaiseNofileLimit(rl.Cur)
	if err != nil || got != rl.Cur {
		t.Fatalf("no-op raise: %d %v", got, err)
	}
	got, err = RaiseNofileLimit(rl.Cur + 10)
	if err != nil || got < rl.Cur {
		t.Fatalf("raise: %d %v", got, err)
	}
	// Beyond fs.nr_open: capped, not an error.
	got, err = RaiseNofileLimit(1 << 40)
	if err != nil || got < rl.Cur || got >= 1<<40 {
		t.Fatalf("huge raise: %d %v", got, err)
	}
	unix.Setrlimit(unix.RLIMIT_NOFILE, &rl)
}

// Guest buffers outside the daemon's mappings: the mapped prefix is
// transferred and EFAULT reported, never a short read that looks like EOF.
func TestUnmappedSegments(t *testing.T) {
	x := newIOFixture(t, 8192)
	v := bufvec.NewVec(2)
	buf := make([]byte, 4096)
	v.Append(bufvec.Segment{Buf: buf, Len: 4096})
	v.Append(bufvec.Segment{GPA: 0x100000, Len: 4096}) // unmapped
	n, errno := x.fs.Read(&gofuse.ReadIn{InHeader: *hdr(x.node), Fh: x.fh, Size: 8192}, v)
	if errno != syscall.EFAULT || n != 4096 {
		t.Fatalf("read: %d %v", n, errno)
	}
	v.Rewind()
	n, errno = x.fs.Write(&gofuse.WriteIn{InHeader: *hdr(x.node), Fh: x.fh, Size: 8192}, v)
	if errno != syscall.EFAULT || n != 4096 {
		t.Fatalf("write: %d %v", n, errno)
	}
	got := -1
	if errno := x.fs.WithHandleFD(x.node, x.fh, func(fd int) syscall.Errno { got = fd; return 0 }); errno != 0 || got < 0 {
		t.Fatalf("WithHandleFD: %d %v", got, errno)
	}
	if errno := x.fs.WithHandleFD(x.node, x.fh+1, func(int) syscall.Errno { return 0 }); errno != syscall.EBADF {
		t.Fatalf("WithHandleFD bad fh: %v", errno)
	}
}
