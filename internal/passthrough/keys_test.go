package passthrough

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestKeyShard: inodes are found by key through growth and removals, two
// objects with one inode number but different handles (a number reused
// after the first object went) are told apart, and each visits every
// inode once.
func TestKeyShard(t *testing.T) {
	var s keyShard
	const n = 5000
	inodes := make([]*inode, n)
	for k := range inodes {
		inodes[k] = &inode{key: inodeKey{dev: 7, ino: uint64(k * 64), mntID: 3}}
		s.add(inodes[k])
	}
	reused := &inode{key: inodeKey{dev: 7, ino: 64, mntID: 3, handle: "other generation"}}
	s.add(reused)
	if s.get(inodes[1].key) != inodes[1] || s.get(reused.key) != reused {
		t.Fatal("inodes with one inode number and different handles mixed up")
	}
	for k := 0; k < n; k += 2 {
		if !s.remove(inodes[k]) || s.remove(inodes[k]) {
			t.Fatalf("inode %d: removed twice or not at all", k)
		}
	}
	for k, i := range inodes {
		if got, want := s.get(i.key), map[bool]*inode{true: nil, false: i}[k%2 == 0]; got != want || s.has(i) != (want != nil) {
			t.Fatalf("inode %d: get %p has %v, want %p", k, got, s.has(i), want)
		}
	}
	if s.get(inodeKey{dev: 7, ino: 1, mntID: 3}) != nil || s.get(inodeKey{dev: staleDev, ino: 64, mntID: 3}) != nil {
		t.Fatal("a key never added found")
	}
	seen := map[*inode]bool{}
	s.each(func(i *inode) { seen[i] = true })
	if len(seen) != n/2+1 || s.n != n/2+1 || !seen[reused] {
		t.Fatalf("each saw %d inodes, the shard counts %d; want %d", len(seen), s.n, n/2+1)
	}
}

// TestFileHandleLayout: nameToHandle's string is the kernel's struct
// file_handle (what x/sys decodes the same way), and open_by_handle_at of
// it opens the same object.
func TestFileHandleLayout(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	h, err := nameToHandle(fd)
	if err == unix.EOPNOTSUPP {
		t.Skip("no file handles on the temp directory's file system")
	}
	if err != nil {
		t.Fatal(err)
	}
	ref, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH)
	if err != nil {
		t.Fatal(err)
	}
	if handleType(h) != ref.Type() || !bytes.Equal(handleBytes(h), ref.Bytes()) || len(h) != handleHeader+ref.Size() {
		t.Fatalf("handle %x: type %d bytes %x; x/sys: type %d bytes %x", h, handleType(h), handleBytes(h), ref.Type(), ref.Bytes())
	}
	mnt, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mnt)
	got, e := sysOpenByHandle(mnt, h, unix.O_PATH|unix.O_CLOEXEC)
	if e == unix.EPERM {
		t.Skip("open_by_handle_at needs CAP_DAC_READ_SEARCH")
	}
	if e != 0 {
		t.Fatal(e)
	}
	defer unix.Close(got)
	var a, b unix.Stat_t
	unix.Fstat(fd, &a)
	unix.Fstat(got, &b)
	if a.Ino != b.Ino || a.Dev != b.Dev {
		t.Fatalf("opened ino %d dev %d, want %d %d", b.Ino, b.Dev, a.Ino, a.Dev)
	}
}
