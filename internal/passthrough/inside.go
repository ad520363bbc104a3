package passthrough

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// A migration stream's file handles open only objects inside the shared
// directory, in every sandbox (none, chroot, namespace).
//
// open_by_handle_at with CAP_DAC_READ_SEARCH opens any object of the file
// system the handle names, whatever directory it is in: a stream from a
// compromised VMM could name the host's /etc/shadow if the share is a
// directory of the root file system. The object's /proc/self/fd link does
// not tell: inside a namespace or chroot sandbox the link of an object
// outside the root reads as a path below "/", and a non-directory opened by
// handle may have no path at all (a disconnected dentry). So the loader
// checks what it opened:
//
//   - a directory is inside if walking ".." from it reaches the shared
//     directory (device, inode number and mount all equal). The kernel
//     keeps a directory's dentry connected to its parent (open_by_handle_at
//     reconnects directories), so ".." is its real parent; the walk follows
//     ".." across mounts exactly as path resolution would, stops at this
//     process's root (the share itself in a sandbox) and at the top of a
//     file system (".." is then the directory itself), and the kernel
//     refuses ".." below a bind mount's root that the object is not under
//     (ENOENT). Each of those ends, and any error, refuses the handle.
//   - any other object is inside if it is found by name, with the very
//     same identity (device, inode number, mount, and file handle), in a
//     directory of the share: the share itself or a directory of the same
//     stream already staged, each of which was checked as above or opened
//     by path beneath the share. A guest holds the directories above every
//     name it looked up (its dentries pin their parents), so a file's
//     directory is in the stream unless the host moved it meanwhile; then
//     the file is unreachable, as with find-paths. The name is what the
//     guest could reach the object by: an object with a name inside the
//     share is inside, whatever other links it has.
//   - an unlinked regular file (st_nlink 0: an open file deleted on the
//     host, or O_TMPFILE) is in no directory, inside the share or out, and
//     is accepted: migrating it is what file-handles mode is for. What a
//     forged handle could reach that way is only a file already deleted
//     that some host process still holds open, named by inode number and
//     generation; the remaining trust in the source, stated here.
//
// Handles the daemon makes itself (LOOKUP, in inode.go's keyFor) need no
// check: they are encoded from an object just reached inside the share.

// maxDotDotWalk bounds the ".." walk of one directory: deeper directories
// (beyond what any path below PATH_MAX can name) are refused.
const maxDotDotWalk = 4096

// insideCheck is one LoadState's memory of the directories found inside
// the share, so a walk stops at the first one already known.
type insideCheck struct {
	f    *FS
	dirs map[objKey]bool
}

// dirInside reports whether directory fd (an O_PATH fd, whose statx is st)
// is the shared directory or below it, and why not.
func (c *insideCheck) dirInside(fd int, st *unix.Statx_t) (bool, string) {
	root := c.f.root.key
	k := objKey{keyOf(st).dev, keyOf(st).ino, keyOf(st).mntID}
	var walked []objKey
	cur := -1 // the fd of the step reached, once it is not fd
	defer func() {
		if cur >= 0 {
			sysClose(cur)
		}
	}()
	for range maxDotDotWalk {
		if (k == objKey{root.dev, root.ino, root.mntID}) || c.dirs[k] {
			for _, w := range walked {
				c.dirs[w] = true
			}
			return true, ""
		}
		walked = append(walked, k)
		from := fd
		if cur >= 0 {
			from = cur
		}
		up, e := sysOpenat(from, &dotDotPath[0], unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if e != 0 {
			return false, "its parent directories do not lead to the shared directory (..: " + e.Error() + ")"
		}
		if cur >= 0 {
			sysClose(cur)
		}
		cur = up
		var ust unix.Statx_t
		if e := statxFD(cur, &ust); e != 0 {
			return false, "statx of a parent: " + e.Error()
		}
		next := objKey{keyOf(&ust).dev, keyOf(&ust).ino, keyOf(&ust).mntID}
		if next == k {
			return false, "it is outside the shared directory"
		}
		k = next
	}
	return false, fmt.Sprintf("it is more than %d directories below anything known inside the shared directory", maxDotDotWalk)
}

var dotDotPath = [3]byte{'.', '.', 0}

// pendingObject is a non-directory opened by file handle, not yet found in
// a directory of the share.
type pendingObject struct {
	k     int32 // its record
	i     *inode
	found bool
}

// findNames looks for each pending object by name in dirs (directories of
// the share: the root and the stream's staged directories), reading each
// once, and marks those found. It stops early once all are.
func (c *insideCheck) findNames(pending []pendingObject, dirs []*inode) {
	want := make(map[uint64][]int, len(pending)) // inode number → indexes in pending
	left := 0
	for n := range pending {
		p := &pending[n]
		if p.found {
			continue
		}
		want[p.i.key.ino] = append(want[p.i.key.ino], n)
		left++
	}
	buf := make([]byte, dirBufSize)
	for _, d := range dirs {
		if left == 0 {
			return
		}
		left -= c.findIn(d, pending, want, buf)
	}
}

// findIn reads directory d for the pending objects whose inode numbers
// want lists; it returns how many it found.
func (c *insideCheck) findIn(d *inode, pending []pendingObject, want map[uint64][]int, buf []byte) int {
	f := c.f
	p, e := f.pathOf(d)
	if e != 0 {
		return 0
	}
	defer p.put()
	var b fdName
	dfd, e := sysOpenat(f.procSelfFD, procName(&b, p.fd), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if e != 0 {
		return 0
	}
	defer sysClose(dfd)
	found := 0
	for {
		n, e := sysGetdents(dfd, buf)
		if e != 0 || n <= 0 {
			return found
		}
		for rec := buf[:n]; ; {
			de, ok := parseDirent(rec)
			if !ok {
				break
			}
			rec = rec[de.reclen:]
			if len(de.name) == 0 || isDotOrDotDot(de.name) || len(want[de.ino]) == 0 {
				continue
			}
			found += c.claim(dfd, de.name, pending, want, de.ino)
		}
	}
}

// claim opens entry name of directory dfd and marks the pending objects of
// inode number ino that it is.
func (c *insideCheck) claim(dfd int, name []byte, pending []pendingObject, want map[uint64][]int, ino uint64) int {
	var cn cname
	fd, e := sysOpenat(dfd, cn.set(name), unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if e != 0 {
		return 0
	}
	defer sysClose(fd)
	var st unix.Statx_t
	if statxFD(fd, &st) != 0 {
		return 0
	}
	found := 0
	rest := want[ino][:0]
	for _, n := range want[ino] {
		if c.f.isObject(fd, &st, pending[n].i) {
			pending[n].found = true
			found++
		} else {
			rest = append(rest, n)
		}
	}
	want[ino] = rest
	return found
}

// unlinkedFile reports whether i is a regular file with no link left.
func (f *FS) unlinkedFile(i *inode) bool {
	if !i.isReg() {
		return false
	}
	p, e := f.pathOf(i)
	if e != 0 {
		return false
	}
	defer p.put()
	var st unix.Statx_t
	return statxFD(p.fd, &st) == 0 && st.Nlink == 0
}
