package passthrough

import "sync"

// keyShard maps host keys to inodes so that two lookups of one object give
// the guest one node id. It is a hash table chained through the inodes
// themselves (inode.keyNext), so an inode costs it 8 bytes in the inode
// and 8 to 16 of bucket array, where a Go map keyed by inodeKey (40
// bytes) costs 50 to 100: with a million inodes held, the difference is
// most of what the table weighs. Every method runs under mu.
type keyShard struct {
	mu      sync.Mutex
	buckets []*inode // a power of two long, or empty
	n       int      // inodes in the shard
	_       [24]byte // a cache line per shard
}

// bucket is where key's chain starts. The low bits of the hash chose the
// shard (keyShards is a power of two), so the bucket takes the next ones.
func (s *keyShard) bucket(k inodeKey) **inode {
	return &s.buckets[int(k.hash()/keyShards)&(len(s.buckets)-1)]
}

// get returns the inode whose key is k, or nil.
func (s *keyShard) get(k inodeKey) *inode {
	if s.n == 0 {
		return nil
	}
	for i := *s.bucket(k); i != nil; i = i.keyNext {
		if i.key == k {
			return i
		}
	}
	return nil
}

// has reports whether i itself is in the shard.
func (s *keyShard) has(i *inode) bool {
	if s.n == 0 {
		return false
	}
	for o := *s.bucket(i.key); o != nil; o = o.keyNext {
		if o == i {
			return true
		}
	}
	return false
}

// add puts i in the shard; no inode with its key may be there. The bucket
// array doubles when the shard holds as many inodes as buckets, so a chain
// is one inode long on average.
func (s *keyShard) add(i *inode) {
	if s.n >= len(s.buckets) {
		s.grow()
	}
	b := s.bucket(i.key)
	i.keyNext = *b
	*b = i
	s.n++
}

func (s *keyShard) grow() {
	old := s.buckets
	s.buckets = make([]*inode, max(8, 2*len(old)))
	for _, i := range old {
		for i != nil {
			next := i.keyNext
			b := s.bucket(i.key)
			i.keyNext = *b
			*b = i
			i = next
		}
	}
}

// remove takes i out of the shard and reports whether it was there.
func (s *keyShard) remove(i *inode) bool {
	if s.n == 0 {
		return false
	}
	for p := s.bucket(i.key); *p != nil; p = &(*p).keyNext {
		if *p == i {
			*p = i.keyNext
			i.keyNext = nil
			s.n--
			return true
		}
	}
	return false
}

// each calls fn on every inode of the shard; fn must not add or remove.
func (s *keyShard) each(fn func(*inode)) {
	for _, i := range s.buckets {
		for ; i != nil; i = i.keyNext {
			fn(i)
		}
	}
}
