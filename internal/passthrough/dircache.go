package passthrough

import (
	"sync"
	"sync/atomic"
)

// The directory fd cache. A directory held by file handle has no fd of
// its own: each request on it would open it by handle (open_by_handle_at,
// which decodes the handle and finds or builds the dentry) and close it
// after. A LOOKUP opens its parent so, and a walk LOOKUPs many names in
// one directory: the open by handle was a fifth of the daemon's CPU time
// on a LOOKUP walk. So a few directories held by handle keep an O_PATH fd
// resident, in the same word as an fd-held inode's (refWord): a request
// finds it with the compare-and-swap that takes its reference.
//
// The cache holds at most dirCacheMax fds (and a quarter of the fd budget
// when that is smaller): with file handles the daemon's fds stay bounded
// whatever the tree, as the handle mode promises. Replacement is a clock
// over the cache's slots: a directory used since the hand last passed
// (its used bit, set by every acquire) is passed over once; one with a
// request under way is never detached (the same compare-and-swap from
// "this fd, the table's reference alone" as the budget's sweep). Files
// and symlinks are not cached: a request on one is rarely followed by
// another on the same object before the guest's caches answer.
//
// A slot keeps the *inode it cached until the hand reuses it, even after
// the inode's teardown (which closes the fd): at most dirCacheMax dead
// inodes stay reachable, which costs less than finding the slot at every
// teardown.

// dirCacheMax bounds the directory fds the cache holds.
const dirCacheMax = 256

type dirCache struct {
	mu    sync.Mutex
	slots []*inode // cap: the cache's size
	hand  int
	fds   atomic.Int64 // resident fds of handle-held directories
}

// dirCacheSize is the cache's size for an fd budget.
func dirCacheSize(budget int64) int {
	return int(min(dirCacheMax, max(budget/4, 1)))
}

// cacheDirFD offers fd, an O_PATH fd just opened for directory i (held by
// handle; the caller holds a use reference), to the cache. It returns the
// fd the caller is to use and whether the caller owns it (closes it after
// the request); on false fd belongs to i.
func (f *FS) cacheDirFD(i *inode, fd int) (int, bool) {
	c := &f.dirs
	c.mu.Lock()
	slot := c.victimLocked()
	if slot < 0 {
		c.mu.Unlock()
		return fd, true
	}
	cur, ok := i.install(fd)
	if !ok {
		c.mu.Unlock()
		sysClose(fd) // another request cached one meanwhile
		return cur, false
	}
	if slot == len(c.slots) {
		c.slots = append(c.slots, i)
	} else {
		c.slots[slot] = i
	}
	c.fds.Add(1)
	f.inodeFDs.Add(1)
	c.mu.Unlock()
	return fd, false
}

// victimLocked returns a free slot (len(slots): a new one), detaching the
// fd of the directory in it if need be; -1 when every directory cached is
// in use.
func (c *dirCache) victimLocked() int {
	if len(c.slots) < cap(c.slots) {
		return len(c.slots)
	}
	for range 2 * len(c.slots) {
		n := c.hand
		c.hand = (c.hand + 1) % len(c.slots)
		if c.evict(c.slots[n]) {
			return n
		}
	}
	return -1
}

// evict detaches and closes d's cached fd unless d is in use or was used
// since the hand last passed; true when its slot is free.
func (c *dirCache) evict(d *inode) bool {
	w := d.ref.Load()
	if wordFD(w) < 0 || wordCount(w) == 0 {
		return true // torn down (its fd closed then), or never installed
	}
	if wordCount(w) != 1 {
		return false
	}
	if w&refUsed != 0 {
		d.ref.CompareAndSwap(w, w&^refUsed)
		return false
	}
	if !d.ref.CompareAndSwap(w, w&^refFDMask) {
		return false
	}
	c.fds.Add(-1)
	d.fs.closeInodeFD(wordFD(w))
	return true
}
